"""The request body's nesting check (proxy/request_limits.py `check_depth`), rewritten for speed in
issue 17: it must refuse exactly what the walk before it refused, at any limit, and never run out
of stack itself."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixtrace.common.errors import InvalidRequest
from proxy.request_limits import parse_body
from proxy.request_limits import MAX_JSON_DEPTH, check_depth


def reference_depth(value) -> int:
    """The nesting depth as the check before issue 17's change computed it: arrays and objects
    count one level each, the outermost is level 1, scalars none."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return deepest


def nested(depth: int, leaf="leaf"):
    value = leaf
    for i in range(depth):
        value = [1, value, "x"] if i % 2 else {"k": "v", "a": value}
    return value


def refused(value, limit: int) -> bool:
    try:
        check_depth(value, limit)
    except InvalidRequest as exc:
        assert f"more than {limit} deep" in exc.message
        return True
    return False


@pytest.mark.parametrize("depth", [0, 1, 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 150])
def test_the_limit_is_where_it_was(depth):
    assert refused(nested(depth), MAX_JSON_DEPTH) == (depth > MAX_JSON_DEPTH)
    # The same through the body parser, as text: what the proxy answers 400 to.
    text = json.dumps({"messages": [], "x": nested(max(depth - 1, 0))})
    if depth > MAX_JSON_DEPTH:
        with pytest.raises(InvalidRequest, match="deep"):
            parse_body(text.encode())
    else:
        parse_body(text.encode())


def test_a_deep_branch_among_many_shallow_ones_is_found():
    wide = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]} for _ in range(500)]}
    check_depth(wide)
    wide["messages"][377]["content"].append(nested(MAX_JSON_DEPTH))  # 3 levels above it: 103 deep
    assert refused(wide, MAX_JSON_DEPTH)


def test_far_deeper_than_python_recursion_is_refused_not_a_recursion_error():
    deep = []
    for _ in range(50_000):  # built here, not parsed: json.loads itself stops near 1000
        deep = [deep]
    assert refused(deep, MAX_JSON_DEPTH)
    assert refused(deep, 300)


def test_a_dict_subclass_at_the_top_is_walked_as_a_dict():
    class Ordered(dict):
        pass

    assert not refused(Ordered(a=nested(MAX_JSON_DEPTH - 1)), MAX_JSON_DEPTH)
    assert refused(Ordered(a=nested(MAX_JSON_DEPTH)), MAX_JSON_DEPTH)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=2), children, max_size=4),
    max_leaves=60,
)


@settings(max_examples=300, database=None, deadline=None)
@given(value=json_values, limit=st.integers(min_value=1, max_value=12))
def test_refuses_exactly_what_the_old_walk_refused(value, limit):
    value = json.loads(json.dumps(value))  # what the parser hands it
    assert refused(value, limit) == (reference_depth(value) > limit)
