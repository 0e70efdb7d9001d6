#!/usr/bin/env bash
# The whole GPU round in one call of at most ~8 minutes, from the repository root of a GPU machine:
#   1. tests/test_cuda.py (graph or eager, Triton kernels, end to end against HF + PEFT)
#   2. benchmarks/vs_vllm.py --device cuda --skip-vllm on the Llama-3.2-1B and Llama-3.1-8B shapes: 256 x (128 + 64)
#      for base / single / mixed8 / mixed32, then batch 1 (1 x (128 + 128)); on a GPU, batch 1 of the first
#      shape again with --enforce-eager (decode without CUDA graphs)
#   3. benchmarks/throughput.py --device cuda on the 1B shape: HF transformers + PEFT on the same device and
#      mixed-adapter workload (the peer present there), with how many greedy rows equal PEFT's
#   4. benchmarks/step_profile.py: one decode step under torch.profiler (top kernels, host against GPU time)
#   5. benchmarks/tune_triton.py on the first shape: the Triton kernels' tiles and splits measured on this GPU, the
#      table in $OUT/tuned/ (commit it as loramux/ops/tuned/<gpu>.json; sizes not reached in its time are left out)
# Each step has its own time limit, so a hang costs that step alone. Results: $OUT/gpu_check.jsonl (each step's
# JSON line, with its name and the device), $OUT/gpu_check.log (everything printed), and $OUT/triton-cache.tgz.
#
# Python packages the GPU image lacks (msgspec, llguidance) travel as wheels: `make gpu-wheels` here puts them
# in .whl/. Triton's compiled kernels travel back as triton-cache.tgz: unpack it into .gpu-cache/ here, and the
# next round compiles nothing it compiled before. The device call:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu-cache"], timeout_s=540)
# Environment: GPU_CHECK_CACHE (default .gpu-cache), GPU_CHECK_WHEELS (default .whl), GPU_CHECK_WORKDIR (the
# random checkpoints and adapters, default ~/.cache/loramux/bench-vs-vllm), GPU_CHECK_SHAPES (default "llama-1b llama-8b"), GPU_CHECK_DEVICE (default cuda), GPU_CHECK_ARGS
# (added to every benchmark's arguments, after the defaults: e.g. "--requests 4" for a smoke test), PYTHON.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-check-out}
CACHE=${GPU_CHECK_CACHE:-$ROOT/.gpu-cache}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
mkdir -p "$OUT" "$CACHE/triton"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SHAPES=${GPU_CHECK_SHAPES:-llama-1b llama-8b}
WORK=${GPU_CHECK_WORKDIR:-$HOME/.cache/loramux/bench-vs-vllm}
read -r -a EXTRA <<< "${GPU_CHECK_ARGS:-}"
export TRITON_CACHE_DIR=$CACHE/triton PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/gpu_check.log
JSONL=$OUT/gpu_check.jsonl
: > "$LOG"
: > "$JSONL"

# step NAME SECONDS COMMAND...: run it within SECONDS, its output to the log, its last JSON line to the JSONL.
step() {
  local name=$1 limit=$2 start rc line
  shift 2
  start=$(date +%s)
  echo "=== $name: $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/step.out" 2>&1
  rc=$?
  cat "$OUT/step.out" >> "$LOG"
  line=$(grep '^{' "$OUT/step.out" | tail -1)
  "$PY" - "$name" "$rc" "$(( $(date +%s) - start ))" "$DEVICE" "${line:-null}" >> "$JSONL" <<'EOF'
import json, sys
name, rc, seconds, device, line = sys.argv[1:]
try:
    result = json.loads(line)
except ValueError:
    result = None
print(json.dumps({"step": name, "rc": int(rc), "seconds": int(seconds), "device": device, "result": result}))
EOF
  echo "=== $name: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$LOG"
  tail -3 "$OUT/step.out"
}

"$PY" - >> "$LOG" 2>&1 <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
EOF
head -1 "$LOG"
if [ "$DEVICE" = cuda ]; then
  step cuda_tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py
fi
for shape in $SHAPES; do
  limit=$([ "$shape" = llama-8b ] && echo 200 || echo 100)
  step "vs_vllm_$shape" "$limit" "$PY" benchmarks/vs_vllm.py --device "$DEVICE" --shape "$shape" --workdir "$WORK" \
    --requests 256 --prompt-len 128 --new-tokens 64 --repeats 1 --skip-vllm "${EXTRA[@]}"
  step "batch1_$shape" 90 "$PY" benchmarks/vs_vllm.py --device "$DEVICE" --shape "$shape" --workdir "$WORK" \
    --requests 1 --prompt-len 128 --new-tokens 128 --repeats 1 --skip-vllm "${EXTRA[@]}"
done
first=${SHAPES%% *}
if [ "$DEVICE" = cuda ]; then  # the same batch-1 run op by op: what the CUDA graphs take off a step
  step "batch1_eager_$first" 90 "$PY" benchmarks/vs_vllm.py --device "$DEVICE" --shape "$first" --workdir "$WORK" \
    --requests 1 --prompt-len 128 --new-tokens 128 --repeats 1 --skip-vllm --enforce-eager "${EXTRA[@]}"
fi
step "peft_$first" 120 "$PY" benchmarks/throughput.py --device "$DEVICE" --model "$WORK/$first/model" \
  --requests 256 --prompt-len 128 --new-tokens 64 --dtypes bfloat16 --repeats 1 "${EXTRA[@]}"
step "profile_$first" 60 "$PY" benchmarks/step_profile.py --device "$DEVICE" --model "$WORK/$first/model" \
  --adapters "$WORK/$first/adapters"
tune=(--tokens 1 8 32 128 --batches 1 8 32 128)
[ "$DEVICE" = cuda ] || tune=(--tokens 1 --batches 1 --quick --dtype float32)  # the interpreter: a smoke test
step "tune_$first" 100 "$PY" benchmarks/tune_triton.py --device "$DEVICE" --shape "$first" --out "$OUT/tuned" "${tune[@]}"
tar -czf "$OUT/triton-cache.tgz" -C "$CACHE" triton
rm -f "$OUT/step.out"
echo "=== done: $JSONL" | tee -a "$LOG"
