"""A short run of the recorder soak (testsupport/recorder_soak.py; bench/soak_recorder.py runs it at
full size): streaming clients hanging up at random points against a real `prefixtrace serve` lose no
turn and record none twice (issue 14, finding 1; the full 64 clients x 2 min figures are in
docs/PERFORMANCE.md)."""

from __future__ import annotations

import pytest

from testsupport.recorder_soak import healthy, soak


@pytest.mark.slow
def test_random_hang_ups_under_load_lose_nothing_and_leave_the_server_answering(tmp_path):
    result = soak(clients=16, seconds=15, p_cut=0.2, seed=1, workdir=tmp_path)
    assert result["disconnects"] > 0 and result["completed"] > 0
    assert result["lost"] == 0, result
    assert result["duplicates"] == 0, result
    assert healthy(result), result
