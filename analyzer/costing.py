"""What each break cost in seconds (`price_breaks`) and in dollars
(`dollars_of_breaks`). The tokens lost are counted during the walk (analyzer/chains.py);
this prices them from the recorded timings, a given rate or a price sheet.
"""

from __future__ import annotations

from analyzer.results import Report, SessionResult, TurnResult

HIT_SHARE = 0.5  # a turn served at least this share of its prompt from cache is a cache hit (seconds, "Cost")
MIN_PREFILL = 64  # uncached tokens a turn must prefill to measure a prefill rate from its TTFT
# A break's TTFT over its cache hits' that prices it below this share of its tokens at the measured
# prefill rate is not believed (the hits queued longer, under load): the rate prices it instead.
TTFT_TRUST = 0.1


def price_breaks(sessions: list[SessionResult], prefill_rate: float | None) -> None:
    """Sets every break's `lost_seconds` and `lost_seconds_basis`, in this order of preference:

    1. `--prefill-rate`: lost_tokens / that rate;
    2. the turn's recorded TTFT against the median TTFT of (up to 3 of) this session's cache hits
       nearest in prompt size (append-only turns served mostly from cache): the extra wait; unless that
       is below TTFT_TRUST of its tokens at the rate of 3 (else 4), as under load when the hits queued
       longer: then that rate prices it (a floor, so a real miss never shows 0 s);
    3. a prefill rate measured from this session's own turns (median of uncached tokens / TTFT over
       turns that prefilled at least MIN_PREFILL tokens): lost_tokens / that rate;
    4. the same rate measured from every session of the same model in the input;
    else None, with a basis that says how to give a rate."""
    def uncached(t: TurnResult) -> int | None:
        if t.prompt_tokens is None:
            return None
        if t.reported_cached_tokens is not None and t.reported_prompt_tokens:
            share = max(0, t.reported_prompt_tokens - t.reported_cached_tokens) / t.reported_prompt_tokens
            return round(share * t.prompt_tokens)
        return t.block_reprefill_tokens if t.block_reprefill_tokens is not None else t.reprefill_tokens

    def rate_of(turns: list[TurnResult]) -> float | None:
        rates = sorted(u / t.ttft_s for t in turns if t.ttft_s and t.ttft_s > 0
                       and (u := uncached(t)) is not None and u >= MIN_PREFILL)
        if not rates:
            return None
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2

    def is_hit(t: TurnResult) -> bool:
        if t.brk is not None or t.ttft_s is None or not t.prompt_tokens or t.note:
            return False
        if t.reported_cached_tokens is not None and t.reported_prompt_tokens:
            return t.reported_cached_tokens >= HIT_SHARE * t.reported_prompt_tokens
        return (t.predicted_cached_tokens or 0) >= HIT_SHARE * t.prompt_tokens

    by_model: dict[str | None, float | None] = {}

    def model_rate(model: str | None) -> float | None:
        if model not in by_model:
            by_model[model] = rate_of([u for x in sessions for u in x.turns if u.model == model])
        return by_model[model]

    for s in sessions:
        for t in s.turns:
            if t.brk is not None and t.lost_tokens is None:
                # A break named after the cost pass (a server-side miss): its tokens are what the server
                # lost, `saves_tokens`, the same definition.
                t.lost_tokens = t.brk.saves_tokens
        breaks = [t for t in s.turns if t.brk is not None and t.lost_tokens is not None]
        if not breaks:
            continue
        hits = [t for t in s.turns if is_hit(t)]
        session_rate = rate_of(s.turns)
        for t in breaks:
            if prefill_rate:
                t.lost_seconds = round(t.lost_tokens / prefill_rate, 2)
                t.lost_seconds_basis = f"--prefill-rate {prefill_rate:,.0f} tok/s"
                continue
            if t.ttft_s is not None and hits:
                near = sorted(hits, key=lambda h: abs(h.prompt_tokens - (t.prompt_tokens or 0)))[:3]
                base = sorted(h.ttft_s for h in near)[len(near) // 2] if len(near) % 2 else \
                    sum(sorted(h.ttft_s for h in near)[len(near) // 2 - 1 : len(near) // 2 + 1]) / 2
                t.lost_seconds = round(max(0.0, t.ttft_s - base), 2)
                hits_text = "cache hit" if len(near) == 1 else f"{len(near)} cache hits"
                t.lost_seconds_basis = (f"TTFT {t.ttft_s:.2f} s against {base:.2f} s, the median TTFT of this "
                                        f"session's {hits_text} nearest in size")
                # Under load a miss's TTFT can fall below its neighbours' (they queued longer): far below
                # what its tokens take at the prefill rate measured from the turns, the comparison says
                # nothing and the rate prices it (3, else 4), never 0 s.
                rate, where = (session_rate, "this session's turns") if session_rate else \
                    (model_rate(t.model), "all recorded turns of this model")
                if rate and t.lost_seconds < TTFT_TRUST * t.lost_tokens / rate:
                    t.lost_seconds = round(t.lost_tokens / rate, 2)
                    t.lost_seconds_basis = (f"prefill rate {rate:,.0f} tok/s measured from {where}: its TTFT "
                                            f"({t.ttft_s:.2f} s) against the median of this session's {hits_text} "
                                            f"nearest in size ({base:.2f} s) says less than {TTFT_TRUST:.0%} of that, "
                                            "as under load, when the turns around it waited longer")
                continue
            if session_rate:
                t.lost_seconds = round(t.lost_tokens / session_rate, 2)
                t.lost_seconds_basis = f"prefill rate {session_rate:,.0f} tok/s measured from this session's turns"
                continue
            rate = model_rate(t.model)
            if rate:
                t.lost_seconds = round(t.lost_tokens / rate, 2)
                t.lost_seconds_basis = f"prefill rate {rate:,.0f} tok/s measured from all recorded turns of this model"
            else:
                t.lost_seconds_basis = "no timings recorded: give --prefill-rate TOK_PER_S to price it in seconds"



def dollars_of_breaks(report: Report, sheet) -> None:
    """Each break's lost tokens in dollars (analyzer/pricing.py `lost_dollars`)."""
    for s in report.sessions:
        for t in s.turns:
            lost = getattr(t, "lost_tokens", None)
            if lost is None and t.brk is not None:
                lost = t.reprefill_tokens
            if t.brk is not None and lost:
                t.lost_dollars = round(sheet.lost_dollars(lost, t.prompt_tokens), 6)
