"""N-gram speculative decoding against plain decoding, in-process, greedy (outputs must match).

    python -m bench.spec_decode [--k 4] [--output-len 96] [--repeats 2] [--batch-sizes 1 2 4 8 16]

Two engines on the same model, one plain and one with `{"method": "ngram"}` (switch-off disabled
so every batch size speculates), stepped in turn on the same requests so machine load favours
neither; tok/s is output tokens over the time spent in each engine's own steps (prefill included). Reports single-stream tok/s on a copy-heavy workload (rewrite a given passage) and a
free-writing one, acceptance per draft position, and per batch size (half copy, half free
prompts) the speedup: the smallest batch size where it drops below 1 is where speculation should
switch itself off (`disable_by_batch_size`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import emit, log, setup_logging

PASSAGE = (
    "The river Thames flows through London and has shaped the city for two thousand years. The Romans "
    "built the first bridge near the site of London Bridge, and the port that grew around it made the "
    "city rich. In the nineteenth century the river was so polluted that Parliament could hardly sit "
    "in the summer heat, and the engineer Joseph Bazalgette built new sewers and embankments that "
    "still carry the city's waste today. Now the river is cleaner than it has been for centuries, and "
    "seals and porpoises have been seen as far upstream as Westminster."
)
COPY = f"Rewrite the following passage, fixing any spelling mistakes:\n\n{PASSAGE}"
FREE = "Write a short story about a dragon who learns to bake bread."


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _interleaved(
    plain: Any, spec: Any, prompts: list[str], params: Any
) -> dict[str, tuple[float, list[list[int]]]]:
    """Both engines run the same requests, one step each in turn, so a load spike on this shared
    machine hits both alike: (seconds spent in its own steps, output ids) per engine."""
    engines = {"plain": plain, "spec": spec}
    ids = {name: [llm.add_request(p, params) for p in prompts] for name, llm in engines.items()}
    spent = dict.fromkeys(engines, 0.0)
    final: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    while any(llm.has_unfinished_requests() for llm in engines.values()):
        for name, llm in engines.items():
            if llm.has_unfinished_requests():
                t0 = time.perf_counter()
                outs = llm.step()
                spent[name] += time.perf_counter() - t0
                for o in outs:
                    if o.finished:
                        final[name][o.request_id] = list(o.outputs[0].token_ids)
    return {name: (spent[name], [final[name][i] for i in ids[name]]) for name in engines}


def _ab(plain: Any, spec: Any, prompts: list[str], params: Any, repeats: int) -> dict[str, Any]:
    """Interleaved runs; tok/s of each engine over all its runs, and acceptance over spec's."""
    times = {"plain": 0.0, "spec": 0.0}
    tokens = {"plain": 0, "spec": 0}
    same = True
    before = spec.engine.stats()
    for _ in range(repeats):
        runs = _interleaved(plain, spec, prompts, params)
        for name, (dt, outs) in runs.items():
            times[name] += dt
            tokens[name] += sum(len(o) for o in outs)
        same &= runs["plain"][1] == runs["spec"][1]
    after = spec.engine.stats()
    drafted = [
        a - b for a, b in zip(after.spec_drafted_per_position, before.spec_drafted_per_position, strict=True)
    ]
    accepted = [
        a - b
        for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position, strict=True)
    ]
    verifications = after.spec_num_drafts - before.spec_num_drafts
    plain_tps, spec_tps = tokens["plain"] / times["plain"], tokens["spec"] / times["spec"]
    return {
        "plain_tok_s": round(plain_tps, 2),
        "spec_tok_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "identical_outputs": same,
        "acceptance_per_position": [
            round(a / d, 3) if d else None for a, d in zip(accepted, drafted, strict=True)
        ],
        "drafted_per_position": drafted,
        "mean_accepted_length": round(1 + sum(accepted) / verifications, 3) if verifications else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--sweep-output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    setup_logging()
    from pagebus import LLM, SamplingParams

    common: dict[str, Any] = {"dtype": args.dtype, "seed": 0, "kv_cache_memory": 256 << 20}
    plain = LLM(args.model, **common)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 1 << 16}
    spec = LLM(args.model, speculative_config=spec_cfg, **common)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (plain, spec):
        llm.generate([_chat(COPY), _chat(FREE)], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    single = {}
    for name, text in (("copy", COPY), ("free", FREE)):
        single[name] = _ab(plain, spec, [_chat(text)], params, args.repeats)
        log.info("single stream %s: %s", name, single[name])
    sweep = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.sweep_output_len, ignore_eos=True)
    for b in args.batch_sizes:
        prompts = [_chat(COPY if i % 2 == 0 else FREE) for i in range(b)]
        sweep[str(b)] = _ab(plain, spec, prompts, params, args.repeats)
        log.info("batch %d: %s", b, sweep[str(b)])
    losing = [b for b in args.batch_sizes if sweep[str(b)]["speedup"] < 1.0]
    emit(
        {
            "bench": "spec_decode",
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "single_stream": single,
            "batch_sweep_half_copy_half_free": sweep,
            "first_batch_size_slower_with_spec": losing[0] if losing else None,
        }
    )


if __name__ == "__main__":
    main()
