"""Grammar-constrained decoding: forced tool calls and JSON replies (docs/TOOLS.md).

llguidance (Microsoft, MIT) compiles the grammar and computes each step's allowed-token bitmask; why
it and not xgrammar or outlines-core is in docs/TOOLS.md (measured by bench/bench_grammar.py). What is
written here is only the glue mlx-lm lacks: a grammar for "one Hermes tool call of these tools", and a
logits processor for mlx-lm's `GenerationBatch` (per row: rows of a batch each have their own grammar or
none). llguidance ships an MLX helper, but it is a Metal kernel; `apply_bitmask` here runs on any MLX
backend (CPU, CUDA, Metal).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from prefixtrace.common.errors import InvalidRequest

log = logging.getLogger("prefixtrace.grammar")

# Compact JSON: a grammar that allows any whitespace lets a weak model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                # A keyword llguidance does not implement (`not`, …) is left unenforced instead of refusing
                # the schema: tools from real harnesses use them; what llguidance does enforce still holds.
                "lenient": True}


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """How much a constrained reply may write where the schema itself sets no bound (docs/TOOLS.md).

    A greedy small model inside a grammar can repeat forever (`"id": "abc_abc_abc…"`, a 400-digit
    session id): the grammar keeps the value valid, so nothing but max_tokens ends it, and on a CPU
    that is half an hour. The grammar instead accepts a bounded subset of what the schema accepts,
    so every value it lets the model write is still valid against the tool's own schema.
    """

    string_chars: int = 4096  # maxLength of a string that sets none (and has no enum/const)
    array_items: int = 64  # maxItems of an array that sets none
    number_magnitude: float = 1e15  # |x| below this, where the schema sets no minimum/maximum
    number_decimals: int = 6  # digits after the point, where the schema sets no multipleOf


DEFAULT_LIMITS = GrammarLimits()
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "if", "then", "else")


def bounded_schema(schema, limits: GrammarLimits = DEFAULT_LIMITS):
    """`schema` with a bound wherever a value could grow without end: strings get a maxLength, arrays
    a maxItems, numbers a range and a number of decimals, objects that list their properties and say
    nothing of others no additional properties. What the schema bounds itself is kept as it is.

    llguidance enforces each of these keywords (its docs/json_schema.md); a typeless value (`{}`, any
    JSON) is left unbounded: max_tokens still ends it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded_schema(v, limits) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(v, limits) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded_schema(out[key], limits)
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "enum" in out or "const" in out:
        return out
    if "string" in types and "maxLength" not in out:
        out["maxLength"] = max(limits.string_chars, _int(out.get("minLength")))
    if "array" in types and "maxItems" not in out:
        out["maxItems"] = max(limits.array_items, _int(out.get("minItems")))
    if types & {"number", "integer"}:
        low = [out[k] for k in ("minimum", "exclusiveMinimum") if _is_number(out.get(k))]
        high = [out[k] for k in ("maximum", "exclusiveMaximum") if _is_number(out.get(k))]
        if not low:  # each side the schema leaves open, never past a bound it sets on the other
            out["minimum"] = min([-limits.number_magnitude, *high])
        if not high:
            out["maximum"] = max([limits.number_magnitude, *low])
        if "integer" not in types and "multipleOf" not in out:
            out["multipleOf"] = 10.0 ** -limits.number_decimals
    if ("object" in types and isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "patternProperties" not in out
            and all(name in out["properties"] for name in out.get("required") or [])):
        out["additionalProperties"] = False
    return out


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray, n_vocab: int) -> mx.array:
    """Logits with every token the bitmask (llguidance's int32 words, bit i of word i // 32) forbids at -inf."""
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
    if logits.shape[-1] > n_vocab:  # a model whose logits are padded past the tokenizer
        allowed = np.concatenate([allowed, np.zeros(logits.shape[-1] - n_vocab, dtype=bool)])
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))


def tool_call_schema(tools: list[dict], name: str | None = None, limits: GrammarLimits | None = DEFAULT_LIMITS) -> dict:
    """JSON schema of one call `{"name": ..., "arguments": {...}}` to one of `tools` (OpenAI function tools),
    or to the tool called `name`; the name comes first, as Hermes-format templates write it. The
    arguments' schema is bounded by `limits` (`bounded_schema`; None: as the tool wrote it)."""
    choices = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {"type": "object"}
        if limits is not None:
            params = bounded_schema(params, limits)
        choices.append({"type": "object", "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not choices:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the request's tools",
                             param="tool_choice")
    return choices[0] if len(choices) == 1 else {"anyOf": choices}


def tool_call_lark(tools: list[dict], name: str | None, start: str, end: str, prefix: str = "",
                   limits: GrammarLimits | None = DEFAULT_LIMITS) -> str:
    """One call in the Hermes format the reply parser reads: start marker, the call object, end marker
    (after `prefix`, text the reply must begin with). Markers are lark terms (`marker_term`)."""
    return json_lark(tool_call_schema(tools, name, limits), [prefix, start, '"\\n"'], ['"\\n"', end])


def json_lark(schema: dict, before: list[str] = (), after: list[str] = ()) -> str:
    """Lark for llguidance: terms, a JSON value of `schema`, terms."""
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    parts = [t for t in before if t] + ["value"] + [t for t in after if t]
    return f"start: {' '.join(parts)}\nvalue: %json {json.dumps(schema)}\n"


class GrammarCompiler:
    """One model's llguidance tokenizer (built once, ~1 s for a 49k vocabulary) and grammar compilation."""

    def __init__(self, tokenizer, n_vocab: int):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        import llguidance.hf

        with self._lock:
            if self._ll_tokenizer is None:
                hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)  # mlx-lm's TokenizerWrapper wraps it
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.n_vocab, eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def marker_term(self, text: str) -> str:
        """A marker as a lark term: a marker that is one special token of the vocabulary (`<tool_call>`
        in Qwen vocabularies) is named by id, `<[id]>`, since llguidance keeps special tokens apart from
        text; any other marker is its text."""
        if not text:
            return ""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self._llg_tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def json_schema(self, schema: dict, prefix: str = "",
                    limits: GrammarLimits | None = DEFAULT_LIMITS) -> "GrammarProcessor":
        import llguidance

        if not isinstance(schema, dict):
            raise InvalidRequest("the JSON schema must be an object", param="response_format")
        lark = json_lark(bounded_schema(schema, limits) if limits is not None else schema, [self._text_term(prefix)])
        return self._matcher(llguidance.LLMatcher.grammar_from_lark(lark), "response_format")

    def tool_call(self, tools: list[dict], name: str | None, start: str, end: str,
                  prefix: str = "", limits: GrammarLimits | None = DEFAULT_LIMITS) -> "GrammarProcessor":
        import llguidance

        lark = tool_call_lark(tools, name, self.marker_term(start), self.marker_term(end), self._text_term(prefix),
                              limits)
        return self._matcher(llguidance.LLMatcher.grammar_from_lark(lark), "tools")

    def _text_term(self, prefix: str) -> str:
        """Text the reply must begin with (`</think>` + blank line), its markers named as `marker_term` does."""
        if not prefix:
            return ""
        marker, rest = prefix.rstrip("\n"), prefix[len(prefix.rstrip("\n")):]
        return " ".join(t for t in (self.marker_term(marker), json.dumps(rest) if rest else "") if t)

    def _matcher(self, grammar: str, param: str) -> "GrammarProcessor":
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg_tokenizer())
        if error:
            raise InvalidRequest(f"the schema cannot be enforced: {error}", param=param)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise InvalidRequest(f"the schema cannot be enforced: {matcher.get_error()}", param=param)
        return GrammarProcessor(matcher, self.n_vocab)


class GrammarProcessor:
    """A logits processor (mlx-lm's `(tokens, logits) -> logits`) that keeps one row inside its grammar.

    `tokens` is the row's whole context: on the first call the prompt (nothing to consume), after that
    each call brings the token sampled last, which the matcher consumes before computing the next mask.
    Reading that token is a host sync, so a batch with a constrained row loses mlx-lm's one-step-ahead
    overlap; rows without a grammar add no processor and keep it (GenerationBatch skips the per-row
    path when no row has one).
    """

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self._seen: int | None = None
        self._bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.failed: str | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._seen is None:
            self._seen = tokens.shape[0]
        elif tokens.shape[0] > self._seen:
            for token in tokens[self._seen:].tolist():
                if self.failed is None and not self.matcher.consume_token(token):
                    self.failed = self.matcher.get_error() or f"token {token} refused"
                    log.error("constrained row left its grammar: %s", self.failed)
            self._seen = tokens.shape[0]
        if self.failed is not None:
            return logits  # nothing sane to force any more; the reply parser reports what came out
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return apply_bitmask(logits, self._bitmask, self.n_vocab)
