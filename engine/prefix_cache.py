"""In-memory prefix cache (v0): reuse the KV of the longest cached prompt prefix.

This is mlx-lm's `LRUPromptCache` (a token trie of whole KV caches with an LRU
and a byte budget) plus the two things it leaves to its caller: an exact count
of the tokens actually reused, and never handing back a cache that covers the
whole prompt (the model must see at least one new token to produce logits).
The paged, block-hashed memory+disk cache of the cache-tiers issue replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


@dataclass(slots=True)
class CacheHit:
    cache: list[Any]  # per-layer KV caches holding exactly `num_cached` tokens
    num_cached: int


class PrefixCache:
    def __init__(self, model, *, max_bytes: int, max_entries: int = 64):
        self._model = model
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.num_lookups = 0
        self.num_hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: list[int]) -> CacheHit:
        """A private copy of the cache for the longest stored prefix of `tokens`."""
        self.num_lookups += 1
        cache, rest = self._lru.fetch_nearest_cache("model", tokens)
        if cache is None:
            return CacheHit(make_prompt_cache(self._model), 0)
        num_cached = len(tokens) - len(rest)
        if num_cached == len(tokens):
            # Exact hit: give back one token so the step that samples the first
            # output token has an input. Only trimmable caches are stored.
            trim_prompt_cache(cache, 1)
            num_cached -= 1
        if cache[0].offset != num_cached:  # the trie and the cache must agree
            return CacheHit(make_prompt_cache(self._model), 0)
        self.num_hit_tokens += num_cached
        return CacheHit(cache, num_cached)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep `cache`, whose first `cache[0].offset` tokens are `tokens[:offset]`.

        The cache object is taken over: the caller must not use it afterwards.
        """
        offset = cache[0].offset
        if offset == 0 or not can_trim_prompt_cache(cache):
            return
        self._lru.insert_cache("model", list(tokens[:offset]), cache)
