#!/usr/bin/env bash
# The GPU path, checked in one go on a machine with one NVIDIA GPU (about 8 minutes on an H100 or
# H200): bfloat16 parity with HF's golden tokens, the Pallas attention backend against dense
# attention, a quick bench of SmolLM2 in bfloat16, and the decode roofline of llama-2-7b with
# random bfloat16 weights. Results go to benchmarks/results/gpu-<gpu name>-*.json.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# It needs jax with CUDA: an environment that already has it (checked first) is used as it is;
# otherwise the `cuda` extra is installed into .venv-gpu. SmolLM2 comes from the model cache
# ($MESHSERVE_CACHE_DIR, else ~/.cache/meshserve), fetched on first use as usual.
set -euo pipefail
cd "$(dirname "$0")/.."

# 1. An interpreter whose jax sees a GPU: the current one, or a fresh venv with the cuda extra.
PY=${PYTHON:-python3}
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  python3 -m venv .venv-gpu
  PY=.venv-gpu/bin/python
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -e '.[cuda,test]'
else
  # jax is there already: install meshserve itself (and its pure-Python needs) beside it.
  "$PY" -m pip install --quiet -e '.[test]'
fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

# 2. Names for the results: the GPU's name as the driver gives it, made file-safe.
GPU=$("$PY" -c 'import jax; print(jax.devices()[0].device_kind)' | tr -cs 'A-Za-z0-9' '-' \
      | sed 's/^-*//; s/-*$//' | tr 'A-Z' 'a-z')
OUT=benchmarks/results
mkdir -p "$OUT"
MESHSERVE="$PY -m meshserve.serving.cli"

# 3. Parity. bfloat16 greedy tokens against HF's golden file: logprobs within 0.25, a token may
#    differ only where HF's top-2 margin is under 0.25 (tests/model/test_golden.py says why).
#    Then the Pallas GPU kernel (the "pallas-gpu" backend) against dense attention, within 2e-2
#    (f32 dots may run as TF32), and the portable backend beside it.
"$PY" -m pytest -q -m slow tests/model/test_golden.py -k bfloat16 -p no:cacheprovider
"$PY" -m pytest -q tests/model/test_ragged_attention.py -p no:cacheprovider

# 4. A quick bench of SmolLM2 in bfloat16 with the default attention ("auto": pallas-gpu here),
#    continuous against static, with the start-up timings and the decode roofline at 1 and 8.
$MESHSERVE bench --quick --dtype bfloat16 --startup --no-progress \
  --output "$OUT/gpu-$GPU-smollm2-bf16-quick.json"

# 5. The decode roofline of a 7B model: llama-2-7b with random bfloat16 weights (13.5 GB), one
#    decode step at batch 1, 8 and 64 against the floor of this GPU's measured bandwidth and
#    matmul rate, with 512 tokens of context per sequence.
$MESHSERVE roofline --model llama-2-7b --dtype bfloat16 --batch 1 --batch 8 --batch 64 \
  --context 512 --output "$OUT/gpu-$GPU-llama-2-7b-bf16-roofline.json"

# 6. The same roofline with weight-only quantized kernels: llama-2-7b's kernels in int8 (a scale
#    per output channel: 6.9 GB) and in int4 (a float16 scale and minimum per 32 weights:
#    4.4 GB), the embedding left in bfloat16 (0.26 GB), activations in bfloat16; each floor from
#    that type's own weight bytes. On a GPU XLA fuses the codes' conversion into the dot, so the
#    step should approach the smaller floor.
for Q in int8 int4; do
  $MESHSERVE roofline --model llama-2-7b --dtype bfloat16 --quantization $Q --batch 1 --batch 8 \
    --batch 64 --context 512 --output "$OUT/gpu-$GPU-llama-2-7b-$Q-roofline.json"
done

echo "results: $OUT/gpu-$GPU-*.json"
