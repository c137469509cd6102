"""Only the relay feeds the turn builder: a reply and its backend tell their turn typed facts
(recorder/turn_facts.py) that travel with what they send, and proxy/relay.py alone hands them to the
`TurnBuilder`. No other module names `TurnBuilder`, holds a builder (a parameter, variable or attribute
called `builder`) or calls a method of one.

Read from the source, in every package of the product. The HAR importer is the one exemption, named with
its reason; an exemption no longer used fails the test."""

import ast
from pathlib import Path

from recorder.turn_builder import TurnBuilder

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("proxy", "recorder", "prefixtrace", "analyzer", "engine")
OWNERS = {"proxy/relay.py", "recorder/turn_builder.py"}
# A HAR holds replies already sent, read back with no relay in between: the importer builds each
# turn by feeding the builder the same facts a live reply tells (`TurnBuilder.feed`, timed=False).
EXEMPT = {"recorder/har.py": "a recorded reply read back, no relay in between"}
METHODS = {name for name, value in vars(TurnBuilder).items() if callable(value)} - {"__init__"}


def _holds_builder(node: ast.AST) -> bool:
    """`builder` as a name, a parameter or an attribute (`self.builder`)."""
    if isinstance(node, ast.Name):
        return node.id == "builder"
    if isinstance(node, ast.arg):
        return node.arg == "builder"
    return isinstance(node, ast.Attribute) and node.attr == "builder"


def builder_uses(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Name) and node.id == "TurnBuilder" or \
                isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == "TurnBuilder":
            found.append(f"{name}:{getattr(node, 'lineno', 0)} names TurnBuilder")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in METHODS \
                and _holds_builder(node.func.value):
            found.append(f"{name}:{node.lineno} calls builder.{node.func.attr}")
        elif _holds_builder(node):
            found.append(f"{name}:{node.lineno} holds a builder")
    return sorted(set(found), key=lambda use: int(use.split(":")[1].split()[0]))


def test_only_the_relay_feeds_the_turn_builder():
    uses, exempt_used = [], set()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OWNERS:
                continue
            found = builder_uses(path.read_text(), rel)
            if found and rel in EXEMPT:
                exempt_used.add(rel)
            elif found:
                uses.extend(found)
    assert uses == [], "the turn builder held or called outside proxy/relay.py:\n" + "\n".join(uses)
    assert exempt_used == set(EXEMPT), f"no longer uses the builder, take it out of EXEMPT: {set(EXEMPT) - exempt_used}"


def test_the_check_sees_each_way_of_holding_the_builder():
    source = ("from recorder.turn_builder import TurnBuilder\n"
              "def a(req, builder):\n    pass\n"
              "def b(self):\n    self.builder.on_request({})\n"
              "def c(reply):\n    reply.feed(1)\n"  # another object's `feed`: not the builder
              "def d(chat):\n    return chat.builder\n"
              "x = TurnBuilder\n")
    assert set(builder_uses(source, "m.py")) == {"m.py:1 names TurnBuilder", "m.py:2 holds a builder",
                                                 "m.py:5 calls builder.on_request", "m.py:5 holds a builder",
                                                 "m.py:9 holds a builder", "m.py:10 names TurnBuilder"}


def test_every_declared_fact_has_one_way_into_the_turn():
    """`TurnBuilder.feed` applies every fact recorder/turn_facts.py declares, and nothing else."""
    from typing import get_args

    from recorder import turn_builder
    from recorder.turn_facts import Fact

    assert set(turn_builder._APPLY) == set(get_args(Fact))
