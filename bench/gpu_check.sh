#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine (from anywhere; it runs from the repo root):
#   (a) pytest over the kernel tests (on CUDA) and the GPU-only worker tests, (b) python -m bench.kernels_gpu,
#   (c) python -m bench.gpu_e2e (a random-weight Llama-3-8B-shaped model, graphs on and off).
# Each part runs under its own timeout; a failing part is recorded and the others still run.
# Prints one JSON object (and writes $OUT/gpu_check.json when $OUT is set); the parts' logs
# go to $OUT (or a temp folder). Exit status: 0 when every part passed.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}

# The GPU box lacks msgspec/pyzmq/gguf (and maybe pytest): install wheels carried in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    else  # e.g. wheels for another Python: go on with what is installed
        echo "gpu_check: installing .whl/ failed; using the installed packages" >&2
    fi
fi
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
PARTS=${OUT:-$(mktemp -d)}
mkdir -p "$PARTS"
echo "gpu_check: parts in $PARTS" >&2
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" >&2
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >&2 || true

run_part() {  # run_part NAME SECONDS CMD...: stdout -> NAME.json, stderr -> NAME.log, status -> NAME.rc
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@" > "$PARTS/$name.json" 2> "$PARTS/$name.log"
    echo $? > "$PARTS/$name.rc"
    echo "gpu_check: $name rc=$(cat "$PARTS/$name.rc") in $((SECONDS - t0))s" >&2
}

# pytest's summary goes to the log; its JSON file stays empty.
# Every kernel test (on a GPU they run on CUDA, not the interpreter) and the CUDA-only worker tests.
# GPU_CHECK_TESTS: other test paths (the CPU smoke test picks one file: the suite runs the rest).
DEFAULT_TESTS="tests/kernels tests/workers/test_gpu_runner.py"
DEFAULT_TESTS+=" tests/workers/test_sampling_batched.py::test_cuda_equals_reference_on_a_seeded_grid"
# shellcheck disable=SC2086
run_part pytest 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" ${GPU_CHECK_TESTS:-$DEFAULT_TESTS}
mv "$PARTS/pytest.json" "$PARTS/pytest.log.stdout" 2> /dev/null
cat "$PARTS/pytest.log.stdout" >> "$PARTS/pytest.log" 2> /dev/null
rm -f "$PARTS/pytest.log.stdout"
run_part kernels_gpu 90 "$PY" -m bench.kernels_gpu
# GPU_E2E_ARGS: extra arguments (e.g. "--tiny ..." to try the script on a machine without a GPU).
# shellcheck disable=SC2086
run_part gpu_e2e 180 "$PY" -m bench.gpu_e2e --json-out - ${GPU_E2E_ARGS:-}

OUT_JSON=()
[ -n "${OUT:-}" ] || OUT_JSON=(--json-out "$PARTS/gpu_check.json")
"$PY" -m bench.gpu_e2e --combine "$PARTS" "${OUT_JSON[@]}"
