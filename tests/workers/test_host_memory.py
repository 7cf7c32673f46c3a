"""workers/host_memory.py: keep_freed_memory (set by every CPU ModelRunner), so a step's freed
activations are reused from the heap, not handed back to the kernel and faulted in (zero-filled)
again by the next step; huge_page_zeros, the CPU KV cache's memory in 2 MiB pages; and
into_huge_pages, which moves a CPU runner's weights into such memory."""

from __future__ import annotations

import gc
import random
import resource

import psutil
import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import SamplingParams
from pagebus.workers.host_memory import huge_page_zeros, into_huge_pages
from pagebus.workers.layers.linear import Linear
from pagebus.workers.runner import ModelRunner


def test_prefills_reuse_the_freed_activations(llm_fp32) -> None:
    """1024-token prefills: ~6,500 minor page faults each under glibc's defaults on the machine this
    was written on, a dozen with the runner's settings."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill() -> None:
        llm_fp32.generate([{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(1024)]}], params)

    prefill()
    prefill()  # the heap has grown to a step's peak
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        prefill()
    per_prefill = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    assert per_prefill < 1000, (
        f"{per_prefill:.0f} page faults a prefill: freed buffers went back to the kernel"
    )


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def _smaps_field(addr: int, field: str) -> list[str]:
    """The values of `field` (e.g. "VmFlags:") of this process's mapping that holds addr
    (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _vm_flags(addr: int) -> list[str]:
    return _smaps_field(addr, "VmFlags:")


def test_huge_page_zeros_is_a_zeroed_tensor_on_a_huge_page_boundary() -> None:
    t = huge_page_zeros((40, 16, 3, 64), torch.float16)  # under 2 MiB: torch.zeros
    assert t.shape == (40, 16, 3, 64) and t.dtype == torch.float16 and not t.any()
    t = huge_page_zeros((1100, 3, 16, 64), torch.float32)  # 12.9 MiB
    assert t.shape == (1100, 3, 16, 64) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0 and not t.any()
    t[-1] = 1.5  # the last element lies inside the buffer
    assert float(t.sum()) == 1.5 * 3 * 16 * 64


def test_huge_page_zeros_is_faulted_in_at_once_and_given_back_with_the_tensor() -> None:
    """Its pages are resident when it returns (the first steps do not fault them in), and its
    mapping goes when the tensor does."""
    proc = psutil.Process()
    nbytes = 128 << 20
    before = proc.memory_info().rss
    t = huge_page_zeros((nbytes // 2,), torch.float16)
    assert proc.memory_info().rss - before >= 0.9 * nbytes
    held = proc.memory_info().rss
    del t
    gc.collect()
    assert held - proc.memory_info().rss >= 0.9 * nbytes


@pytest.mark.skipif(_thp_mode() == "absent", reason="this kernel has no transparent huge pages")
def test_huge_page_zeros_memory_is_advised_into_huge_pages() -> None:
    """The range is marked for huge pages (VmFlags hg); whether the kernel then finds free 2 MiB
    pages for it is its own affair (late in a long test run, fragmented memory gave none)."""
    t = huge_page_zeros((64 << 20,), torch.uint8)
    assert "hg" in _vm_flags(t.data_ptr()), "the KV cache's memory was not advised into huge pages"
    assert "hg" in _vm_flags(t.data_ptr() + t.numel() - 1)


def _anon_huge_kib(addr: int) -> int:
    return int(_smaps_field(addr, "AnonHugePages:")[0])


def _free_huge_pages() -> int:
    """Free 2 MiB blocks the buddy allocator holds (/proc/buddyinfo, orders 9 and up)."""
    try:
        with open("/proc/buddyinfo") as f:
            return sum(
                int(n) << (order - 9) for line in f for order, n in enumerate(line.split()[4:]) if order >= 9
            )
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(_thp_mode() == "absent", reason="this kernel has no transparent huge pages")
def test_huge_page_zeros_mapping_is_private_so_anonymous_huge_pages_apply() -> None:
    """A shared anonymous mapping is shmem: its huge pages follow shmem_enabled ("never" by
    default), not the advice, so the cache took the hg flag and stayed in 4 KiB pages. Private,
    the kernel backs it with anonymous huge pages where it has free 2 MiB blocks to give."""
    t = huge_page_zeros((16 << 20,), torch.uint8)
    assert "sh" not in _vm_flags(t.data_ptr()), "the KV cache's mapping is shared (shmem): no huge pages"
    if _thp_mode() != "never" and _free_huge_pages() >= 64:  # 128 MiB of them free: 8 are asked for
        assert _anon_huge_kib(t.data_ptr()) > 0, "the KV cache's memory holds no huge page"


def test_cpu_runner_kv_caches_start_on_huge_page_boundaries(default_model: str) -> None:
    cfg = EngineConfig(dtype="float32", kv_cache_memory=256 << 20, kv_cache_dtype="float16")
    runner = ModelRunner(cfg, default_model)
    for k, v in runner.kv_caches:
        assert k.data_ptr() % (2 << 20) == 0 and v.data_ptr() % (2 << 20) == 0
        assert not k.any() and not v.any()


def test_into_huge_pages_moves_dense_tensors_keeping_their_values_and_layout() -> None:
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(1100, 1000, generator=g).bfloat16()  # over 2 MiB in all: a mapping of its own
    transposed = torch.randn(64, 96, generator=g).t()  # a view: strides (1, 96)
    param = torch.nn.Parameter(torch.randn(5000, generator=g), requires_grad=False)
    gapped = torch.randn(8, 8, generator=g)[:, :4]  # not dense: stays
    empty = torch.zeros(0)
    tensors = [plain, transposed, param, gapped, empty]
    before = [(t.clone(), t.stride(), t.data_ptr()) for t in tensors]
    moved = into_huge_pages(tensors)
    assert moved == sum(t.numel() * t.element_size() for t in (plain, transposed, param))
    for t, (values, stride, ptr) in zip(tensors, before, strict=True):
        assert torch.equal(t, values) and t.stride() == stride
        assert (t.data_ptr() == ptr) == (t is gapped or t is empty)
    # one mapping, in the order given, each at a 4 KiB boundary
    ptrs = [plain.data_ptr(), transposed.data_ptr(), param.data_ptr()]
    assert ptrs == sorted(ptrs) and all(p % 4096 == 0 for p in ptrs)
    assert plain.data_ptr() % (2 << 20) == 0
    assert isinstance(param, torch.nn.Parameter)


def test_cpu_runner_weights_are_in_huge_page_memory_and_its_matmuls_bound_to_them(default_model: str) -> None:
    """The runner moved the weights (one mapping, advised into huge pages where the kernel has
    them) and every Linear's bound matmul reads the moved tensors, not the freed ones."""
    runner = ModelRunner(EngineConfig(dtype="float32", kv_cache_memory=64 << 20), default_model)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears
    for m in linears:
        assert m.native_mm is None or m.native_mm[1][0].data_ptr() == m.weight.data_ptr()
    if _thp_mode() != "absent":
        assert "hg" in _vm_flags(linears[0].weight.data_ptr())
    out = runner.model.model.layers[0].mlp.down_proj(torch.ones(1, runner.model_config.intermediate_size))
    assert bool(torch.isfinite(out).all())
