"""prefixtrace: caching reverse proxy and prompt-stability analyzer for agent traffic."""

__version__ = "0.1.0"
