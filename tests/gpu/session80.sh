#!/usr/bin/env bash
# Fifty-eighth session: every call does something on whatever GPU comes (carry .whl).
#   On an H200: issue 4's reading, the TMA sweep and its table (tests/gpu/session77.sh, ~550 s), nothing else.
#   On any other GPU: one part of the whole test suite with CUDA present, so `gpu` tests run and every
#   `kernel_device` test launches its kernel on the GPU instead of the interpreter. The whole `-m gpu` set last ran
#   in the fourteenth session; since then each change ran only its own GPU tests.
#     PART=1  -m gpu tests/runtime/test_speculator_gpu.py (captured rounds, agreement with HF greedy; ~540 s cold)
#     PART=2  -m gpu, every other file (ops ~220 s, models and the rest of runtime ~110 s)
#     PART=3  -m "not gpu" tests/ops (the kernel tests, on CUDA)
#     PART=4  -m "not gpu", everything but tests/ops
#   T_TESTS  the part's limit (default 540 s); what a part did not reach shows in its log's last lines.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TREECOMPILE_CACHE=/tmp/tc_cache TORCHINDUCTOR_CACHE_DIR=/tmp/ic
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())"); echo "gpu: $gpu"
case $gpu in *H200*) exec bash tests/gpu/session77.sh;; esac
bash tests/gpu/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 3; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/env.txt"
case ${PART:-1} in
  1) args=(-m gpu tests/runtime/test_speculator_gpu.py);;
  2) args=(-m gpu --ignore=tests/runtime/test_speculator_gpu.py tests);;
  3) args=(-m "not gpu" tests/ops);;
  4) args=(-m "not gpu" --ignore=tests/ops tests);;
  *) echo "unknown PART ${PART}"; exit 2;;
esac
echo "part ${PART:-1}: pytest ${args[*]}"
timeout "${T_TESTS:-540}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 "${args[@]}" \
  > "$OUT/tests_part${PART:-1}.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|error" "$OUT/tests_part${PART:-1}.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests_part${PART:-1}.log" | head -20
true
