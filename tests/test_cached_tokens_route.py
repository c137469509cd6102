"""`cached_tokens` reaches a turn by one route: a `Usage` fact fed to the `TurnBuilder` (alone or inside a
read chunk or body), whether the usage came in the stream or in the whole body, in OpenAI's or Anthropic's
terms."""

import ast
from pathlib import Path

from prefixtrace.wire.messages import usage_counts
from recorder.turn import Turn
from recorder.turn_builder import TurnBuilder
from recorder.turn_facts import ChatBody, ChatChunk, openai_usage

ROOT = Path(__file__).resolve().parent.parent
OPENAI_USAGE = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}


def _builder() -> TurnBuilder:
    return TurnBuilder(Turn(request_id="r", started_at=0.0, endpoint="/v1/chat/completions",
                            upstream="u", request_body="{}"))


def _counts(turn: Turn) -> tuple:
    return turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens, turn.usage


def test_openai_usage_in_the_stream_and_in_the_body_record_the_same():
    streamed = _builder()
    streamed.feed(ChatChunk.read({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}))
    streamed.feed(ChatChunk.read({"choices": [], "usage": OPENAI_USAGE}))
    whole = _builder()
    whole.feed(ChatBody.read({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                           "finish_reason": "stop"}], "usage": OPENAI_USAGE}))
    assert _counts(streamed.finish(200)) == _counts(whole.finish(200)) == (120, 7, 96, OPENAI_USAGE)


def test_anthropic_usage_split_over_the_stream_records_what_the_body_records():
    start = {"input_tokens": 20, "cache_read_input_tokens": 96, "cache_creation_input_tokens": 4, "output_tokens": 1}
    streamed = _builder()
    streamed.feed(usage_counts(start))
    streamed.feed(usage_counts({**start, "output_tokens": 7}))  # message_delta's running usage
    whole = _builder()
    whole.feed(usage_counts({**start, "output_tokens": 7}))
    assert _counts(streamed.finish(200)) == _counts(whole.finish(200))
    assert whole.turn.cached_tokens == 96 and whole.turn.prompt_tokens == 120


def test_unreported_cache_stays_unknown_not_a_miss():
    builder = _builder()
    builder.feed(openai_usage({"prompt_tokens": 5, "completion_tokens": 1}))
    assert builder.turn.cached_tokens is None


def test_only_the_builder_assigns_cached_tokens():
    writers = []
    for folder in ("proxy", "recorder", "prefixtrace/wire"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Attribute) and t.attr == "cached_tokens":
                            writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [w for w in writers if not w.startswith("recorder/turn_builder.py:")] == []
    assert len(writers) == 1, writers  # one route: the builder's `Usage` handler
