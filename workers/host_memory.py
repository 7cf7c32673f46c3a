"""Host memory for a CPU worker: glibc malloc settings, so that freed activation buffers stay
mapped for the next step, and huge pages for the KV cache and the weights.

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
import math
import mmap

import torch

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


# Huge pages for the KV cache. Decode attention reads each sequence's blocks wherever they lie
# in a cache of GiBs: with 4 KiB pages nearly every 2 KiB head run is a TLB miss and a page walk.
# In 2 MiB pages the whole cache fits the second-level TLB. Zen 3, two threads, 30 layers' decode
# attention over 4,096-block float16 caches, tables shuffled, 30 interleaved rounds, paired
# medians (2 MiB / 4 KiB pages): 32 x 192 tokens 0.90, 64 x 192 0.91, one sequence of 1,024 0.93.
# Linux gives huge pages to an anonymous range that asks for them (madvise) where
# transparent_hugepage is "always" or "madvise", as far as it finds free 2 MiB pages; where it is
# "never" or the call is refused, the cache is ordinary memory and works the same. The mapping
# must be private: a shared anonymous one (Python's mmap default, used here before) is shmem, whose
# huge pages follow shmem_enabled instead ("never" by default), so the advice was taken (VmFlags
# hg) and every page stayed 4 KiB.
# The cost is at start-up, and only in some VMs: a guest hands its free 2 MiB blocks back to the
# host (free page reporting), so faulting huge pages in makes the host back every one of them
# anew. On the Zen 3 VM above, LLM() with its 1 GiB cache took 5.3-8.2 s against 4.2-5.2 s in 4
# KiB pages (fresh processes alternated); on bare metal zeroing 1 GiB takes ~0.1 s either way.
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in as writes would, without writing it


def _madvise(addr: int, length: int, advice: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(addr, length, advice) == 0


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, its memory advised into 2 MiB pages before it is
    first touched (see above). Below one huge page, plain torch.zeros.

    The memory is an anonymous mapping of its own, which the kernel hands out zeroed, faulted in
    at once (MADV_POPULATE_WRITE) so the first steps do not fault it: no pass of ours writes the
    zeros again. Zen 3 VM, a 1 GiB float16 cache in 60 tensors, fresh processes alternated:
    1.10-2.60 s -> 0.73-0.82 s (zero_() over malloc'd memory, which the kernel had zeroed too).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE:
        return torch.zeros(shape, dtype=dtype)
    # One spare huge page, so that the tensor can start on a 2 MiB boundary of the mapping.
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = -addr % _HUGE
    length = (nbytes + _HUGE - off) // _HUGE * _HUGE
    if not _madvise(addr + off, length, _MADV_HUGEPAGE):
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV cache is in ordinary pages")
    # the tensor keeps the mapping alive; it is unmapped with the mmap object
    t = torch.frombuffer(buf, dtype=torch.uint8)[off : off + nbytes].view(dtype).view(shape)
    if not _madvise(addr + off, length, _MADV_POPULATE_WRITE):
        t.zero_()  # an older kernel: touching every page faults them in (as huge pages)
    return t


def memory_order(t: torch.Tensor) -> list[int]:
    """The permutation of t's dims that lays its storage out contiguously (a CPU weight can be a
    transposed view, layers/linear.py `_weight_storage`)."""
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda d: (-strides[d], d))


# The weights in huge pages too. A decode step streams every weight from DRAM, tile after tile;
# in 4 KiB pages that is a TLB miss and a page walk every 4 KiB (66,000 a step for the default
# model in bf16), and the hardware prefetcher stops at each page's end. Zen 4, bf16 tiles of the
# default model's 121 matmuls, 4 KiB apart in one 2 MiB-page mapping against torch's own
# allocations, 30 interleaved rounds, paired medians: one row (a single stream's GEMVs) 0.945 and
# 0.954 of the time, 64 rows 0.973 and 0.975.
_WEIGHT_ALIGN = 4096


def into_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Move each dense CPU tensor's data (`.data`, so a Parameter keeps its identity) into one
    mapping of huge_page_zeros, in the order given, at offsets that are multiples of 4 KiB, with
    its shape and strides; others (empty, not dense, not on the CPU) stay where they are. Whoever
    took a reference to an old tensor (a layer's bound matmul) must take it again. Returns the
    bytes moved."""
    dense = []
    for t in tensors:
        order = memory_order(t)
        if t.device.type == "cpu" and t.numel() > 0 and t.permute(order).is_contiguous():
            dense.append((t, order))
    slots, total = [], 0
    for t, _ in dense:
        slots.append(total)
        total += -(-t.numel() * t.element_size() // _WEIGHT_ALIGN) * _WEIGHT_ALIGN
    if total == 0:
        return 0
    arena = huge_page_zeros((total,), torch.uint8)
    for (t, order), start in zip(dense, slots, strict=True):
        flat = t.permute(order)
        nbytes = t.numel() * t.element_size()
        moved = arena[start : start + nbytes].view(t.dtype).view(flat.shape)
        moved.copy_(flat)
        t.data = moved.permute(sorted(range(t.dim()), key=order.__getitem__))
    return sum(t.numel() * t.element_size() for t, _ in dense)
