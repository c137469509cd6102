"""pytest plugin: the `assert_prefix_stable` fixture.

Registered through the `pytest11` entry point, so a harness's test suite
gets it by installing prefixtrace:

    def test_todo_updates_keep_the_prefix(assert_prefix_stable):
        requests = drive_harness_with_fakes(turns=5)   # your request bodies
        assert_prefix_stable(requests, allow="compaction", template="qwen3.jinja")
"""

from __future__ import annotations

import pytest

from analyzer.check import assert_prefix_stable as _assert_prefix_stable


@pytest.fixture
def assert_prefix_stable():
    """`assert_prefix_stable(requests, allow=..., template=...)`: fails the
    test at the first transition that is neither append-only nor allowed."""
    return _assert_prefix_stable
