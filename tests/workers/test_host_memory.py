"""keep_freed_memory (set by every CPU ModelRunner): a step's freed activations are reused from
the heap, not handed back to the kernel and faulted in (zero-filled) again by the next step."""

from __future__ import annotations

import random
import resource

from pagebus.bus.messages import SamplingParams


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
