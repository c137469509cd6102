"""Which renderer and tokenizer count the prompts: the user's, else the server's own as the proxy
recorded it, else a named fallback (docs/ANALYZER.md "The server's renderer")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from analyzer.render import GenericRenderer, recorded_renderer
from analyzer.tokens import Tokenizer, as_tokenizer, tokenizer_from_json
from prefixtrace.common.errors import InvalidRequest


@dataclass
class RendererChoice:
    renderer: Any
    tokenizer: Tokenizer
    source: str  # "recorded" | "given" | "fallback"
    note: str
    exact: bool  # the tokenizer is the server's: counts compare as numbers


def _recorded_tokenizer(info) -> tuple[Tokenizer | None, str]:
    """The recorded renderer's tokenizer: its stored tokenizer.json; (None, why) when there is none.
    A recorded `tokenizer_path` is never opened: the database may come from anyone, and the path
    could name a FIFO, /dev/zero or any file of the reader's (the user passes --tokenizer instead)."""
    name = f"recorded:{info.model}"
    if info.tokenizer_json is not None:
        try:
            return tokenizer_from_json(info.tokenizer_json, name), ""
        except InvalidRequest:
            return None, "its stored tokenizer cannot be loaded"
    if info.tokenizer_problem:
        return None, info.tokenizer_problem
    if info.tokenizer_path:
        return None, f"its tokenizer ({info.tokenizer_path}) was too big to store"
    return None, "no tokenizer was recorded with it"


def choose_renderer(loaded, renderer, tokenizer) -> RendererChoice:
    """Which renderer and tokenizer count the prompts (docs/ANALYZER.md "The server's renderer"): what
    the user gave; else what the proxy recorded for these requests (the renderer most of them name: its
    template, and its tokenizer when one was recorded); else the generic renderer and tiktoken, with a
    note naming the fallback and how to give the right one."""
    info, problem = None, ""
    if renderer is None:
        counts: dict[str, int] = {}
        for req in loaded.requests:
            if req.renderer_id is not None and req.renderer_id in loaded.renderers:
                counts[req.renderer_id] = counts.get(req.renderer_id, 0) + 1
        if counts:
            rid = max(counts, key=lambda k: counts[k])
            info = loaded.renderers[rid]
            try:
                renderer = recorded_renderer(info)
            except InvalidRequest as exc:
                info, problem = None, f"the renderer recorded for {loaded.renderers[rid].model} cannot be used: {exc.message}"
    given_tok = tokenizer is not None
    tok, tok_problem = None, ""
    if tokenizer is None and info is not None:
        tok, tok_problem = _recorded_tokenizer(info)
    exact = (given_tok and not str(tokenizer).startswith(("regex", "tiktoken:"))) or (tok is not None)
    tok = tok or as_tokenizer(tokenizer)
    if info is not None:
        whose = "the upstream published" if info.source == "upstream" else "the server recorded"
        if tok_problem:
            note = (f"rendered with the chat template {whose} for {info.model}, counted with {tok.name} ({tok_problem}), "
                    f"so counts are estimates: pass --tokenizer with the model's tokenizer.json for the server's")
        else:
            note = f"rendered with the chat template and counted with the tokenizer {whose} for {info.model}"
        # Requests served elsewhere (another model or upstream) are counted with it too: say so. Those of the
        # same server without a renderer of their own (token counting, legacy completions) are not news.
        same = {req.upstream for req in loaded.requests if req.renderer_id == info.id}
        others = sum(1 for req in loaded.requests if req.renderer_id != info.id and req.upstream not in same)
        if others:
            note += (f" ({others} of {len(loaded.requests)} requests were served by another model or upstream and "
                     f"are counted with it too: pass --model DIR for theirs)")
        return RendererChoice(renderer, tok, "recorded", note, exact)
    if renderer is not None or given_tok:
        r = renderer or GenericRenderer()
        return RendererChoice(r, tok, "given", f"rendered with {r.name} and counted with {tok.name}, as given", exact)
    served = sorted({req.upstream for req in loaded.requests if req.upstream})
    engines = [u.split(":", 1)[1] for u in served if u.startswith("embedded:")]
    where = (f"served by the embedded model {', '.join(engines)}: pass --model with the directory it was served "
             f"from (prefixtrace serve loads the bundled one from ~/.cache/prefixtrace/models/)") if engines else (
        "pass --model DIR (the served model's directory: its chat template and tokenizer.json) or "
        "--template FILE.jinja --tokenizer tokenizer.json")
    why = problem or "no renderer was recorded with these requests"
    note = (f"{why}: fell back to the generic ChatML renderer and {tok.name}, so token counts and offsets are "
            f"estimates, not the server's; {where}")
    return RendererChoice(GenericRenderer(), tok, "fallback", note, False)


def recorded_choice(info) -> RendererChoice | None:
    """The renderer and tokenizer of one recorded renderer (recorder/renderers.py RendererInfo), as
    `choose_renderer` would pick them for its requests; None when its template cannot be used. The
    live dashboard counts with it, so its numbers are `analyze`'s."""
    try:
        renderer = recorded_renderer(info)
    except InvalidRequest:
        return None
    tok, problem = _recorded_tokenizer(info)
    tok = tok or as_tokenizer(None)
    whose = "the upstream published" if info.source == "upstream" else "the server recorded"
    note = f"rendered with the chat template and counted with the tokenizer {whose} for {info.model}" if not problem else \
        f"rendered with the chat template {whose} for {info.model}, counted with {tok.name} ({problem})"
    return RendererChoice(renderer, tok, "recorded", note, not problem)
