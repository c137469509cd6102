"""The decode kernels' constants live on pages of their own (engine/decode_attention.py, `OWN_PAGE`):
MLX's CUDA allocator puts every array of <= 8 bytes into one read-mostly managed pool that every host
scalar shares, and a host write there makes the next kernel reading a constant wait on a page fault."""

import mlx.core as mx
import numpy as np

from engine import decode_attention as da
from engine import tq_mma


def test_constants_are_a_page_each_with_their_values_first():
    for a, first in ((da._scalar(0.125), [0.125]), (da._zeros(3), [0, 0, 0]), (tq_mma.params5(0.5, 640), [0.5, 640.0])):
        assert a.nbytes == da.OWN_PAGE > 8
        v = np.array(a)
        assert list(v[:len(first)]) == first and not v[len(first):].any()
    assert da._scalar(0.125) is da._scalar(0.125)  # made once: the host never writes it again


def test_kernel_starts_copies_each_left_padding_once_onto_its_own_page():
    pads = mx.array([3, 0, 7])
    starts = da.kernel_starts(pads)
    assert starts.dtype == mx.int32 and starts.nbytes == da.OWN_PAGE
    assert np.array(starts)[:3].tolist() == [3, 0, 7] and not np.array(starts)[3:].any()
    assert da.kernel_starts(pads) is starts  # the same cache's array: no new copy per step
    other = mx.array([3, 0, 7])
    assert da.kernel_starts(other) is not starts  # a new left-padding array (rows changed): a new copy
    wide = mx.array(np.array([5, 1], np.int64))
    assert np.array(da.kernel_starts(wide))[:2].tolist() == [5, 1] and da.kernel_starts(wide).dtype == mx.int32


def test_kernel_starts_forgets_old_arrays_and_never_confuses_a_reused_id():
    keep = [mx.array([i, i + 1]) for i in range(70)]
    for a in keep:
        da.kernel_starts(a)
    assert len(da._STARTS) <= 64
    # an entry answers only for the very array it was made from
    a = keep[-1]
    key = id(a)
    stale = mx.array([9, 9])
    da._STARTS[key] = (stale, da.kernel_starts(stale))
    assert np.array(da.kernel_starts(a))[:2].tolist() == [69, 70]


def test_counters_are_zeros_on_a_page_of_their_own():
    class Owner:
        pass

    c = da.counters(Owner(), 8 * 4)
    assert c.dtype == mx.int32 and c.size >= 32 and c.nbytes == da.OWN_PAGE and not np.array(c).any()
