"""glibc malloc settings for a CPU worker: freed activation buffers stay mapped for the next step.

By default glibc serves an allocation above its mmap threshold (128 KiB, raised dynamically up to
32 MiB) with a fresh mmap and returns it with munmap when freed, and trims the heap's free top
above 128 KiB. A step allocates and frees its activations (a 1024-token prefill: buffers of 1-6 MiB
each layer), so every step faulted their pages in again, zero-filled by the kernel, and the
kernel's mm_percpu_wq worker spent its time on the pages given back, on a core the worker's threads
need: over eight 1024-token requests to `pagebus serve`, 0.48 s of that kernel thread's CPU (60 ms
a request, one fifth of a prefill). With the threshold fixed at glibc's largest (so it no longer
adapts) and trimming off, freed blocks are reused from the heap. In-process 1024-token prefills
on a 2-core AVX-512/AMX machine: bf16 6,500-7,000 minor faults each -> 12 (median 280 -> 271 ms),
float32 76,000 -> a dozen (tests/workers/test_host_memory.py); 64-sequence decode +2-4%.
The cost: the heap keeps its peak size (the largest step's activations, tens of MiB here).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (4 MiB * sizeof(long)); more is refused
_NO_TRIM = (1 << 31) - 1  # an int: trimming only above 2 GiB of free heap top


def keep_freed_memory() -> bool:
    """Set the two options on this process's glibc malloc; False (and nothing changed) where the
    C library is not glibc or refuses them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _NO_TRIM))
    if not ok:
        log.debug("mallopt refused the worker's malloc settings; freed buffers go back to the kernel")
    return ok
