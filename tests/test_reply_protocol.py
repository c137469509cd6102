"""Every reply is a declared `Reply` (proxy/backend.py): the relay reads replies through the
protocol's members only, never by probing them (getattr/hasattr), and no reply class forwards
unknown names (__getattr__)."""

import ast
from pathlib import Path

import pytest

from proxy.anthropic import EngineMessages, TokenCount, UpstreamCount, UpstreamMessages
from proxy.chat_completions import EngineChatCompletion, UpstreamChat
from proxy.completions import EngineCompletion
from proxy.responses import EngineResponses, UpstreamResponses

PROXY = Path(__file__).resolve().parent.parent / "proxy"
# The names the relay and the adapters give an opened reply.
REPLY_NAMES = {"chat", "reply"}
REPLY_CLASSES = [EngineMessages, TokenCount, UpstreamCount, UpstreamMessages, EngineChatCompletion, UpstreamChat,
                 EngineCompletion, EngineResponses, UpstreamResponses]
STREAMING = {EngineMessages, UpstreamMessages, EngineChatCompletion, UpstreamChat, EngineCompletion,
             EngineResponses, UpstreamResponses}


def _subject(node: ast.expr) -> str | None:
    """`chat` for `chat` and for `self.chat`; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def probes_of_replies() -> list[str]:
    found = []
    for path in sorted(PROXY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and node.args \
                    and _subject(node.args[0]) in REPLY_NAMES:
                found.append(f"{path.name}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
    return found


def test_no_module_in_proxy_probes_a_reply():
    assert probes_of_replies() == []


@pytest.mark.parametrize("cls", REPLY_CLASSES, ids=lambda c: c.__name__)
def test_reply_classes_declare_the_protocol_and_forward_nothing(cls):
    assert not any("__getattr__" in vars(k) for k in cls.__mro__), f"{cls.__name__} forwards by __getattr__"
    members = ["streams_events", "stage", "cancel", "whole", "on_final"] + (["sse"] if cls in STREAMING else [])
    missing = [m for m in members if not hasattr(cls, m)]
    assert missing == [], f"{cls.__name__} lacks {missing}"


def test_paced_upstream_response_forwards_nothing():
    from proxy.upstream_backend import _Paced
    assert "__getattr__" not in vars(_Paced)
