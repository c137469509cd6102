"""A block's bytes from the GPU to the host for the disk writer, without MLX and without the GIL.

Why by hand: MLX (0.32, CUDA) has no API for a device-to-host copy into memory the
caller owns. Reading a device array on the host (`memoryview`, `np.array`) goes
through `Buffer::raw_ptr`, which moves the whole buffer into fresh managed memory with
a synchronous `cudaMemcpy` while the Python binding still holds the GIL (the engine
thread then waits for the writer between prefill chunks), and the buffer stays managed
memory: once freed it returns to MLX's buffer cache, and the next GPU array of that size
(the next block's copies) is written into host-resident managed pages through GPU page
faults, on the prefill's own stream. Together: the 1.15x / 1.23-1.31x cold prefill with a
disk tier of docs/PERFORMANCE.md (issue 17).

Here instead:

* the engine thread stages a block as ONE flat uint8 device array (its arrays back to
  back: the block file's payload, engine/disk_cache.py) with the chunk's own `mx.eval`,
  and a one-thread kernel (`mx.fast.cuda_kernel`) that writes that array's device address
  into an 8-byte output (MLX keeps outputs of <= 8 bytes in its host-visible scalar pool:
  reading it moves nothing);
* the writer thread copies the payload with the CUDA driver's `cuMemcpyDtoH` (ctypes
  releases the GIL for the call; the copy engine does the work, the SMs never see it)
  into a pinned host buffer it reuses, then frames and writes it as before.

The writer holds the flat array until its bytes are copied, so MLX cannot free or reuse
the buffer meanwhile; the address is read only after the engine's eval of it finished.
Nothing here runs on the CPU (the writer reads the block's own buffer there), and any
failure to load or call the driver turns the path off with one log line (`available`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from functools import lru_cache

import mlx.core as mx
import numpy as np

log = logging.getLogger("prefixtrace.cache")

# The address, or 0 when the array is not one contiguous run (never for a fresh flat
# array, but then the writer falls back to MLX's own host read instead of copying
# whatever lies at the address).
_POINTER_SOURCE = """
    out[0] = (flat_strides[0] == 1) ? reinterpret_cast<unsigned long long>(flat) : 0ull;
"""


@lru_cache(maxsize=1)
def _pointer_kernel():
    return mx.fast.cuda_kernel(name="prefixtrace_device_address", input_names=["flat"], output_names=["out"],
                               source=_POINTER_SOURCE, ensure_row_contiguous=False)


def device_address(flat: mx.array) -> mx.array:
    """A lazy (1,) uint64 array: where `flat` (1-D) lives on the device."""
    return _pointer_kernel()(inputs=[flat], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                             output_shapes=[(1,)], output_dtypes=[mx.uint64])[0]


class _Driver:
    """The few CUDA driver calls the copy needs (libcuda.so.1, which MLX's CUDA build links)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")  # CDLL: every call releases the GIL
        u64, p = ctypes.c_uint64, ctypes.c_void_p
        self.lib.cuMemcpyDtoH_v2.argtypes = [p, u64, ctypes.c_size_t]
        self.lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(p), ctypes.c_size_t, ctypes.c_uint]
        self.lib.cuMemFreeHost.argtypes = [p]
        self.lib.cuCtxSetCurrent.argtypes = [p]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), ctypes.c_int]
        self.check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = p()
        # MLX's runtime works in the device's primary context: the same one, so its addresses are valid here.
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.local = threading.local()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise OSError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def current(self) -> None:
        if not getattr(self.local, "ready", False):
            self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            self.local.ready = True


_driver: _Driver | None = None
_driver_failed = False
_lock = threading.Lock()


def available() -> bool:
    """Whether the driver path can run here (a CUDA device and libcuda); logged once if not."""
    global _driver, _driver_failed
    if _driver is not None:
        return True
    if _driver_failed or not mx.cuda.is_available() or mx.default_device().type == mx.DeviceType.cpu:
        return False
    with _lock:
        if _driver is None and not _driver_failed:
            try:
                driver = _Driver()
                _self_test(driver)
                _driver = driver
            except (OSError, AttributeError, RuntimeError, ValueError) as exc:
                _driver_failed = True
                log.warning("prefix cache: no CUDA driver copy for the disk tier (%s); MLX reads blocks instead", exc)
    return _driver is not None


def _self_test(driver: _Driver) -> None:
    """Build the address kernel and copy a known array back once, so that a kernel that does not
    compile or a copy that does not work turns the path off here, not inside a prefill's eval."""
    probe = (mx.arange(4096) % 251).astype(mx.uint8)
    address = device_address(probe)
    mx.eval(probe, address)
    where = int(address.item())
    if not where:
        raise OSError("the device address kernel gave 0")
    out = np.empty(probe.size, np.uint8)
    driver.current()
    driver.check(driver.lib.cuMemcpyDtoH_v2(out.ctypes.data, where, out.nbytes), "cuMemcpyDtoH")
    if not np.array_equal(out, np.arange(4096) % 251):
        raise OSError("the driver copy read other bytes than the array holds")


class PinnedBuffer:
    """A page-locked host buffer reused for every block one writer thread copies (grown when needed)."""

    def __init__(self):
        self._ptr, self._size = ctypes.c_void_p(), 0

    def view(self, nbytes: int) -> np.ndarray:
        if nbytes > self._size:
            self.close()
            size = max(nbytes, 1 << 20)
            _driver.current()
            _driver.check(_driver.lib.cuMemHostAlloc(ctypes.byref(self._ptr), size, 0), "cuMemHostAlloc")
            self._size = size
        return np.ctypeslib.as_array((ctypes.c_uint8 * self._size).from_address(self._ptr.value))[:nbytes]

    def close(self) -> None:
        if self._size:
            _driver.lib.cuMemFreeHost(self._ptr)
            self._ptr, self._size = ctypes.c_void_p(), 0


def copy_to_host(address: int, out: np.ndarray) -> None:
    """`out.nbytes` bytes from device `address` into `out` (contiguous host memory); GIL released."""
    _driver.current()
    _driver.check(_driver.lib.cuMemcpyDtoH_v2(out.ctypes.data, address, out.nbytes), "cuMemcpyDtoH")


_scratch = threading.local()


def host_bytes(address: int, nbytes: int) -> np.ndarray:
    """`nbytes` from device `address` in this thread's pinned buffer (a view, valid until the
    thread's next call)."""
    buf = getattr(_scratch, "buffer", None)
    if buf is None:
        buf = _scratch.buffer = PinnedBuffer()
    out = buf.view(nbytes)
    copy_to_host(address, out)
    return out
