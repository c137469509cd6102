"""Dollars for prompt tokens, from genai-prices' maintained price data.

The rates (input, cache read, cache write, per million tokens, with the providers' "cliff" tiers:
past a tier's start every token of the request pays the tier's rate) come from the `genai-prices`
package, which tracks the providers' published prices; nothing here is a price table written by
hand. The library prices one usage at a time through Decimal arithmetic (~0.5 ms a call), too slow
for a 10,000-turn recording priced under four caches, so the sheet reads the model's rates once and
applies the same tier rule per request in floats (tests/test_pricing.py checks it against the
library's own `calc_price`).

What a break costs in dollars: the tokens it lost (docs/ANALYZER.md, "The cost of a break") were
paid at the rate of fresh input (on a provider that charges cache writes, the write rate, since the
re-sent tail is written again) instead of the cache-read rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from prefixtrace.common.errors import InvalidRequest

PER_TOKEN = 1e-6  # the library's prices are per million tokens


@dataclass(frozen=True)
class Rate:
    """USD per token below the first tier, and (start, rate) tiers in ascending order."""

    base: float
    tiers: tuple[tuple[int, float], ...] = ()

    def at(self, request_input_tokens: int) -> float:
        rate = self.base
        for start, tier_rate in self.tiers:
            if request_input_tokens > start:
                rate = tier_rate
        return rate


def _rate(price) -> Rate | None:
    if price is None:
        return None
    if isinstance(price, Decimal | int | float):
        return Rate(float(price) * PER_TOKEN)
    return Rate(float(price.base) * PER_TOKEN,
                tuple((int(t.start), float(t.price) * PER_TOKEN) for t in sorted(price.tiers, key=lambda t: t.start)))


@dataclass(frozen=True)
class PriceSheet:
    """One model's prompt-side rates. `cache_read` / `cache_write` fall back to the input rate
    where the provider has none (no cache discount, or writes that cost nothing extra)."""

    model: str  # as genai-prices names it
    provider: str
    input: Rate
    cache_read: Rate
    cache_write: Rate
    charges_cache_writes: bool

    def prompt_dollars(self, prompt_tokens: int, cached_tokens: int = 0, written_tokens: int = 0) -> float:
        """One request's prompt: `cached_tokens` read from the cache, `written_tokens` of the rest
        written to it (charged only where the provider charges writes), the others fresh input."""
        cached = max(0, min(cached_tokens, prompt_tokens))
        written = max(0, min(written_tokens, prompt_tokens - cached)) if self.charges_cache_writes else 0
        fresh = prompt_tokens - cached - written
        n = prompt_tokens
        return fresh * self.input.at(n) + cached * self.cache_read.at(n) + written * self.cache_write.at(n)

    def lost_dollars(self, lost_tokens: int, prompt_tokens: int | None = None) -> float:
        """What `lost_tokens` that should have been cache reads cost over reading them."""
        n = prompt_tokens or lost_tokens
        paid = self.cache_write.at(n) if self.charges_cache_writes else self.input.at(n)
        return max(0, lost_tokens) * (paid - self.cache_read.at(n))

    def describe(self) -> str:
        per_m = lambda r: f"${r.base / PER_TOKEN:g}"  # noqa: E731
        parts = [f"{per_m(self.input)}/M input", f"{per_m(self.cache_read)}/M cache read"]
        if self.charges_cache_writes:
            parts.append(f"{per_m(self.cache_write)}/M cache write")
        tiered = " (higher past " + ", ".join(f"{s:,}" for s, _ in self.input.tiers) + " tokens)" if self.input.tiers else ""
        return f"{self.model} ({self.provider}): {', '.join(parts)}{tiered}; genai-prices data"

    def to_dict(self) -> dict:
        return {"model": self.model, "provider": self.provider, "input_per_mtok": self.input.base / PER_TOKEN,
                "cache_read_per_mtok": self.cache_read.base / PER_TOKEN,
                "cache_write_per_mtok": self.cache_write.base / PER_TOKEN if self.charges_cache_writes else None,
                "tiers": [start for start, _ in self.input.tiers], "source": "genai-prices"}


def price_sheet(model: str, provider: str | None = None) -> PriceSheet:
    """The rates of `model` (e.g. "claude-sonnet-4-5", "gpt-5") as genai-prices knows them;
    an unknown name is a clear error, not a guess."""
    try:
        from genai_prices import Usage, calc_price
    except ImportError as exc:  # a declared dependency; only a broken install lacks it
        raise InvalidRequest("pricing needs the genai-prices package: pip install genai-prices") from exc
    try:
        found = calc_price(Usage(input_tokens=0, output_tokens=0), model, provider_id=provider)
    except LookupError as exc:
        raise InvalidRequest(f"no price known for model {model!r}"
                             f"{f' at provider {provider!r}' if provider else ''} (genai-prices {exc}); give a "
                             "provider's model name, e.g. claude-sonnet-4-5 or gpt-5") from exc
    mp = found.model_price
    base = _rate(mp.input_mtok)
    if base is None:
        raise InvalidRequest(f"genai-prices has no input price for {model!r}")
    read = _rate(mp.cache_read_mtok)
    write = _rate(mp.cache_write_mtok)
    return PriceSheet(model=found.model.name or model, provider=found.provider.id, input=base,
                      cache_read=read or base, cache_write=write or base, charges_cache_writes=write is not None)
