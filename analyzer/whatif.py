"""What the same traffic would cost under other servers' prefix caches (`analyze --what-if`).

The analysis gives, per turn, the prompt length and the prefix it shares with its session's previous
prompt (both in the analysis tokenizer's tokens). Each policy turns that into the tokens such a cache
would serve, by the rules its documentation states (sources in docs/ANALYZER.md "What if"):

- `vllm`: automatic prefix caching on full blocks only (`--block-size`, default 16 tokens); blocks
  that no running request holds stay cached until evicted, least recently used first and, within a
  request, tail blocks first.
- `sglang`: RadixAttention, a radix tree over tokens (page size 1 unless `--page-size`), least
  recently used leaves evicted first.
- `anthropic`: only prefixes ending at a `cache_control` breakpoint are written; a later request
  reads the longest live entry its prompt still starts with, provided it reaches the model's minimum
  cacheable length; an entry lives 5 minutes from its last use. Harnesses mark the last message of
  each request (or use automatic caching, which does the same), so each turn's prompt end is an entry.
  The lookup walks back at most 20 content blocks from the breakpoint (analyzer/lookback.py): an entry
  further behind is not found (`lost_to.lookback`).
- `openai`: automatic for prompts of 1,024 tokens or more, hits in increments of 128 tokens from the
  start, requests routed by a hash of the prompt's first ~256 tokens (a change there lands elsewhere:
  a miss), entries evicted after about 5-10 minutes of inactivity (5 minutes used here).

Sessions are priced independently: what two sessions share (one system prompt) is not credited, so
every figure is a lower bound on what a real cache would serve. Eviction is modelled only when a KV
budget is given (`--kv-budget TOKENS`, for vLLM/SGLang): the server's whole cache, shared by all
sessions in time order. Turns without a time are taken as immediate (no TTL expiry).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from analyzer.lookback import LOOKBACK_BLOCKS
from analyzer.pricing import PriceSheet

POLICIES = ("vllm", "sglang", "anthropic", "openai")
VLLM_BLOCK = 16
ANTHROPIC_TTL_S = 300.0
OPENAI_TTL_S = 300.0
OPENAI_MIN, OPENAI_STEP, OPENAI_ROUTE = 1024, 128, 256
# Minimum cacheable prompt length per Claude model (platform.claude.com prompt-caching docs).
ANTHROPIC_MIN = (("opus-4-6", 4096), ("opus-4-5", 4096), ("haiku-4-5", 4096), ("haiku-3", 2048),
                 ("3-haiku", 2048), ("3-5-haiku", 2048), ("sonnet-4-6", 2048))
ANTHROPIC_MIN_DEFAULT = 1024


def anthropic_min(model: str | None) -> int:
    name = (model or "").lower().replace(".", "-")
    return next((n for key, n in ANTHROPIC_MIN if key in name), ANTHROPIC_MIN_DEFAULT)


@dataclass
class _Turn:
    session: str
    ts: float | None
    order: int
    prompt: int
    common: int
    cause: str | None
    model: str | None
    blocks: int | None = None  # a Messages request's content blocks (Anthropic's 20-block lookback)


class _LRU:
    """Resident tokens per session under a token budget; evicts the least recently used session's
    tail first (what block LRU with tail-first freeing, or radix leaf LRU, amounts to per session)."""

    def __init__(self, budget: int | None):
        self.budget, self.resident, self.total = budget, OrderedDict(), 0
        self.evicted = 0

    def get(self, session: str) -> int:
        return self.resident.get(session, 0)

    def put(self, session: str, tokens: int) -> None:
        self.total += tokens - self.resident.pop(session, 0)
        self.resident[session] = tokens
        if self.budget is None:
            return
        while self.total > self.budget and self.resident:
            victim, held = next(iter(self.resident.items()))
            cut = min(held, self.total - self.budget)
            self.total -= cut
            self.evicted += cut
            if held - cut:
                self.resident[victim] = held - cut
                if victim == session:  # the newest does not fit whole: keep what fits
                    break
            else:
                del self.resident[victim]


def _shared(t) -> int:
    """The prefix the session's previous prompt could give: a `lookback` break's analysis already applied
    Anthropic's rule to `common_prefix_tokens`, which each policy here applies (or not) itself."""
    common = t.common_prefix_tokens or 0
    return common + t.brk.saves_tokens if t.brk is not None and t.brk.cause == "lookback" else common


def _turns(report) -> list[_Turn]:
    out = []
    for s in report.sessions:
        for t in s.turns:
            if t.prompt_tokens is None:
                continue
            out.append(_Turn(s.id, t.ts, t.line if t.line is not None else len(out), t.prompt_tokens,
                             _shared(t), t.brk.cause if t.brk else None, t.model,
                             getattr(t, "blocks", None)))
    out.sort(key=lambda t: (t.ts if t.ts is not None else float("-inf"), t.order))
    return out


def price(report, policy: str, *, block_size: int | None = None, kv_budget: int | None = None,
          min_cacheable: int | None = None, sheet: PriceSheet | None = None) -> dict[str, Any]:
    """Cached and re-prefilled tokens of `report`'s traffic under `policy`, and where the misses came from;
    with a price sheet (analyzer/pricing.py), also the prompt side in dollars under this cache, with no
    cache, and with a cache that served every shared prefix."""
    if policy not in POLICIES:
        raise ValueError(f"unknown --what-if policy {policy!r}; known: {', '.join(POLICIES)}")
    turns = _turns(report)
    cache = _LRU(kv_budget if policy in ("vllm", "sglang") else None)
    unit = block_size or (VLLM_BLOCK if policy == "vllm" else 1)
    last_ts: dict[str, float] = {}
    entries: dict[str, list[tuple[int, float | None, int | None]]] = {}  # anthropic: (prompt end, last use, blocks)
    # Tokens the exact-prefix ideal (the analysis' common prefix) would have served and this cache does not.
    lost = {"block_rounding": 0, "breakpoints": 0, "eviction": 0, "ttl": 0, "min_length": 0, "routing": 0,
            "lookback": 0}
    ideal = 0
    by_cause: dict[str, int] = {}
    total = cached_total = 0
    dollars = {"this_cache": 0.0, "no_cache": 0.0, "exact_prefix": 0.0}
    for t in turns:
        total += t.prompt
        shared = t.common  # what the previous prompt of the session could give at best
        ideal += shared
        expired = False
        if t.ts is not None and t.session in last_ts:
            gap = t.ts - last_ts[t.session]
            expired = gap > (ANTHROPIC_TTL_S if policy == "anthropic" else OPENAI_TTL_S) and \
                policy in ("anthropic", "openai")
        if policy in ("vllm", "sglang"):
            aligned = shared // unit * unit
            resident = cache.get(t.session)
            cached = min(aligned, resident)
            lost["block_rounding"] += shared - aligned
            lost["eviction"] += aligned - cached
            cache.put(t.session, t.prompt // unit * unit)
        elif policy == "anthropic":
            floor = min_cacheable or anthropic_min(t.model)
            mine = entries.get(t.session, [])
            live = [(end, used, at) for end, used, at in mine
                    if not (t.ts is not None and used is not None and t.ts - used > ANTHROPIC_TTL_S)]
            # The lookup walks back at most LOOKBACK_BLOCKS content blocks from this request's breakpoint.
            seen = [e for e in live if e[2] is None or t.blocks is None or t.blocks - e[2] <= LOOKBACK_BLOCKS]
            cached = max((end for end, _, _ in seen if floor <= end <= shared), default=0)
            reachable = max((end for end, _, _ in live if floor <= end <= shared), default=0)
            if reachable > cached:
                lost["lookback"] += reachable - cached
            if cached:
                lost["breakpoints"] += shared - max(cached, reachable)  # the prefix past the last entry it reaches
            elif shared and not reachable:
                if any(floor <= end <= shared for end, _, _ in mine):
                    lost["ttl"] += shared
                elif shared < floor or any(end <= shared for end, _, _ in mine):
                    lost["min_length"] += shared
                else:
                    lost["breakpoints"] += shared
            elif shared:
                lost["breakpoints"] += shared - reachable
            live = [(end, t.ts if end == cached else used, at) for end, used, at in live]
            live.append((t.prompt, t.ts, t.blocks))
            entries[t.session] = live[-32:]
        else:  # openai
            floor = min_cacheable or OPENAI_MIN
            if expired:
                cached = 0
                lost["ttl"] += shared
            elif t.prompt < floor or shared < floor:
                cached = 0
                lost["routing" if shared < OPENAI_ROUTE else "min_length"] += shared
            else:
                cached = floor + (shared - floor) // OPENAI_STEP * OPENAI_STEP
                lost["block_rounding"] += shared - cached
        if t.session in last_ts or t.ts is not None:
            last_ts[t.session] = t.ts if t.ts is not None else last_ts.get(t.session, 0.0)
        cached_total += cached
        if sheet is not None:
            # Only Anthropic-style caches write (and charge for) the new tail at each request's breakpoint.
            writes = policy == "anthropic" and t.prompt >= (min_cacheable or anthropic_min(t.model))
            dollars["this_cache"] += sheet.prompt_dollars(t.prompt, cached, t.prompt - cached if writes else 0)
            dollars["no_cache"] += sheet.prompt_dollars(t.prompt)
            dollars["exact_prefix"] += sheet.prompt_dollars(t.prompt, shared, t.prompt - shared if writes else 0)
        if t.cause:
            by_cause[t.cause] = by_cause.get(t.cause, 0) + (t.prompt - cached)
    return {
        "policy": policy,
        "rules": _rules(policy, unit, kv_budget, min_cacheable),
        "prompt_tokens": total,
        "ideal_cached_tokens": ideal,
        "cached_tokens": cached_total,
        "reprefill_tokens": total - cached_total,
        "hit_rate": round(cached_total / total, 4) if total else None,
        "lost_to": {k: v for k, v in lost.items() if v},
        "break_turns_reprefill_by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1])),
        **({"dollars": {k: round(v, 4) for k, v in dollars.items()}, "priced_as": sheet.describe()}
           if sheet is not None else {}),
    }


def _rules(policy: str, unit: int, budget: int | None, floor: int | None) -> str:
    if policy == "vllm":
        return f"full {unit}-token blocks, LRU eviction" + (f" under a {budget:,}-token KV budget" if budget else " (no budget: nothing evicted)")
    if policy == "sglang":
        return f"radix tree, page size {unit}, LRU leaf eviction" + (f" under a {budget:,}-token KV budget" if budget else " (no budget: nothing evicted)")
    if policy == "anthropic":
        return (f"breakpoint at each request's last message, minimum {floor or 'per model (1,024-4,096)'} tokens, "
                f"{ANTHROPIC_TTL_S / 60:.0f}-minute TTL from last use, {LOOKBACK_BLOCKS}-block lookback")
    return (f"automatic from {floor or OPENAI_MIN:,} tokens, {OPENAI_STEP}-token increments, routing on the first "
            f"~{OPENAI_ROUTE} tokens, {OPENAI_TTL_S / 60:.0f}-minute inactivity eviction")


def what_if(report, policies: list[str], **kwargs: Any) -> list[dict[str, Any]]:
    return [price(report, p, **kwargs) for p in policies]


def parse_policies(value: str | None) -> list[str]:
    if not value:
        return []
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        from prefixtrace.common.errors import InvalidRequest

        raise InvalidRequest(f"unknown --what-if policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    return names
