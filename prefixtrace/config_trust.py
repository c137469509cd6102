"""Which settings a config file may give without the user's say.

A `prefixtrace.toml` that `find_config` picked up from the working directory may
have come with a cloned repository: nobody chose it. Such a file still sets the
harmless options (ports, limits, formats), but the options that could send the
user's prompts or keys somewhere else, widen who can reach the proxy, run code or
templates it ships, or write outside the working directory are withheld, and the
file is announced on stderr with every key it sets. The user accepts the withheld
keys by naming the file (`prefixtrace --config FILE`, or `$PREFIXTRACE_CONFIG`),
by giving them as flags, or by moving the file to their own config directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

# Options whose value decides where data or credentials go, who can connect, or
# what foreign code and templates run: never taken from a file the user did not name.
SENSITIVE: dict[tuple[str, ...], set[str]] = {
    ("serve",): {"host", "allowed_hosts", "allow_client_templates", "upstreams", "otlp_endpoint", "model"},
    ("run",): {"url", "upstreams", "serve_args", "executable"},
    ("analyze",): {"otlp_endpoint", "template", "model", "tokenizer_spec"},
    ("check",): {"template", "model", "tokenizer_spec"},
    ("replay",): {"targets"},
    ("models",): {"model"},
}
# Paths written to: taken from such a file only when they stay inside the working
# directory once resolved (symlinks followed), so it cannot overwrite the user's
# files or put recorded prompts where others read them.
WRITTEN_PATHS: dict[tuple[str, ...], set[str]] = {
    ("serve",): {"db", "cache_dir"},
    ("run",): {"db"},
    ("analyze",): {"out"},
    ("check",): {"junit"},
    ("export",): {"out"},
    ("import",): {"db"},
    ("replay",): {"out"},
}


@dataclass
class Screened:
    """A config file's default_map with the withheld keys taken out."""

    default_map: dict[str, Any]
    keys: list[str] = field(default_factory=list)  # every key the file sets, as `[serve] port`
    withheld: list[str] = field(default_factory=list)


def is_trusted(path: Path, explicit: bool, user_config: Path) -> bool:
    """A file the user named, or the one in their own config directory."""
    return explicit or path.resolve() == user_config.resolve()


def screen(default_map: dict[str, Any], root: click.Group, cwd: Path | None = None) -> Screened:
    """`default_map` without the options a file nobody named may not set."""
    cwd = (cwd or Path.cwd()).resolve()
    out = Screened({})
    _screen(default_map, root, (), out.default_map, out, cwd)
    return out


def _screen(table: dict, command: click.Command, path: tuple[str, ...], kept: dict, out: Screened,
            cwd: Path) -> None:
    subcommands = getattr(command, "commands", {})
    params = {p.name: p for p in getattr(command, "params", [])}
    for name, value in table.items():
        if name in subcommands and isinstance(value, dict):
            kept[name] = {}
            _screen(value, subcommands[name], (*path, name), kept[name], out, cwd)
            continue
        label = f"[{' '.join(path)}] {_flag(params.get(name), name)}"
        out.keys.append(label)
        if name in SENSITIVE.get(path, ()) or (name in WRITTEN_PATHS.get(path, ()) and not _inside(value, cwd)):
            out.withheld.append(label)
        else:
            kept[name] = value


def _flag(param: click.Parameter | None, name: str) -> str:
    longs = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return longs[0][2:] if longs else name.replace("_", "-")


def _inside(value: Any, cwd: Path) -> bool:
    try:
        resolved = (cwd / Path(str(value)).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return resolved == cwd or cwd in resolved.parents


def grouped(keys: list[str]) -> str:
    """`[serve] port, host; [run] url` from `[serve] port`, `[serve] host`, `[run] url`."""
    tables: dict[str, list[str]] = {}
    for key in keys:
        table, _, name = key.partition("] ")
        tables.setdefault(table + "]", []).append(name)
    return "; ".join(f"{table} {', '.join(names)}" for table, names in tables.items())


def announcement(path: Path, screened: Screened) -> list[str]:
    """What to say on stderr about a config file nobody named."""
    lines = [f"prefixtrace: using {path} from the working directory (not given with --config); "
             f"it sets {grouped(screened.keys) or 'nothing'}"]
    if screened.withheld:
        lines.append(f"prefixtrace: not applied from it: {grouped(screened.withheld)}: these could send your prompts "
                     "or keys elsewhere, widen who can reach the proxy, run what the file names, or write outside "
                     "this directory")
        lines.append(f"prefixtrace: to apply them: prefixtrace --config {path} <command> ..., or give them as flags")
    return lines
