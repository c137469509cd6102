"""The decode kernels' constants live on pages of their own (engine/kernels/, `OWN_PAGE`):
MLX's CUDA allocator puts every array of <= 8 bytes into one read-mostly managed pool that every host
scalar shares, and a host write there makes the next kernel reading a constant wait on a page fault."""

import mlx.core as mx
import numpy as np

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401


def test_constants_are_a_page_each_with_their_values_first():
    for a, first in ((common.scalar(0.125), [0.125]), (common.zeros(3), [0, 0, 0]), (tq_mma.params5(0.5, 640), [0.5, 640.0])):
        assert a.nbytes == common.OWN_PAGE > 8
        v = np.array(a)
        assert list(v[:len(first)]) == first and not v[len(first):].any()
    assert common.scalar(0.125) is common.scalar(0.125)  # made once: the host never writes it again


def test_kernel_starts_copies_each_left_padding_once_onto_its_own_page():
    pads = mx.array([3, 0, 7])
    starts = common.kernel_starts(pads)
    assert starts.dtype == mx.int32 and starts.nbytes == common.OWN_PAGE
    assert np.array(starts)[:3].tolist() == [3, 0, 7] and not np.array(starts)[3:].any()
    assert common.kernel_starts(pads) is starts  # the same cache's array: no new copy per step
    other = mx.array([3, 0, 7])
    assert common.kernel_starts(other) is not starts  # a new left-padding array (rows changed): a new copy
    wide = mx.array(np.array([5, 1], np.int64))
    assert np.array(common.kernel_starts(wide))[:2].tolist() == [5, 1] and common.kernel_starts(wide).dtype == mx.int32


def test_kernel_starts_forgets_old_arrays_and_never_confuses_a_reused_id():
    keep = [mx.array([i, i + 1]) for i in range(70)]
    for a in keep:
        common.kernel_starts(a)
    assert len(common._STARTS) <= 64
    # an entry answers only for the very array it was made from
    a = keep[-1]
    key = id(a)
    stale = mx.array([9, 9])
    common._STARTS[key] = (stale, common.kernel_starts(stale))
    assert np.array(common.kernel_starts(a))[:2].tolist() == [69, 70]
