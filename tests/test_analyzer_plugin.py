"""The pytest fixture a harness's own suite uses (entry point `pytest11: prefixtrace = analyzer.pytest_plugin`)."""

import pytest

# Imported so the test runs before the entry point is installed; with it, this shadows the same fixture.
from analyzer.pytest_plugin import assert_prefix_stable  # noqa: F401

GROWING = [{"messages": [{"role": "user", "content": "a"}]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]


def test_fixture_passes_a_growing_conversation(assert_prefix_stable):  # noqa: F811
    assert_prefix_stable(GROWING)


def test_fixture_names_the_break(assert_prefix_stable):  # noqa: F811
    edited = [GROWING[1], {"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "b"}]}]
    with pytest.raises(AssertionError, match="history_edit"):
        assert_prefix_stable(edited)
