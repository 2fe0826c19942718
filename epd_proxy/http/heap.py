"""Memory glibc holds free, given back to the system while the server runs."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


class HeapTrimmer:
    """Gives memory glibc holds free back to the system.

    Request bodies are large buffers; once a burst of uploads is gone glibc keeps their memory in
    its heap for reuse (measured: 56 MB kept after 200 uploads of 300 KB), so RSS would stay at
    the peak. malloc_trim(0) returns it in well under a millisecond; it runs only when glibc holds
    more than `threshold` bytes free. The threshold is well below what "given back" is held to
    (within 8 MB of the baseline, tests/http/test_slow_clients.py): at 8 MiB, free memory just
    under it was kept and RSS stayed 9 MB up in a full test run. A no-op without glibc."""

    def __init__(self, interval_s: float = 2.0, threshold: int = 2 << 20) -> None:
        self.interval_s = interval_s
        self.threshold = threshold
        self._trim = self._free = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self._trim = libc.malloc_trim
            self._trim.argtypes = [ctypes.c_size_t]
            mallinfo2 = libc.mallinfo2
            mallinfo2.restype = _MallInfo2
            self._free = lambda: mallinfo2().fordblks
        except (OSError, AttributeError):
            pass

    def trim_if_worth_it(self) -> bool:
        if self._trim is None or (self._free is not None and self._free() < self.threshold):
            return False
        self._trim(0)
        return True

    async def run(self) -> None:
        if self._trim is None:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            self.trim_if_worth_it()
