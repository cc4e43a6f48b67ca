#!/usr/bin/env bash
# Everything the Triton kernels need checked on a GPU, in one run of under 8 minutes:
#   1. the kernel tests natively on CUDA: the fp32 comparisons and the fp16/bf16 full-size
#      ones (marked gpu), and the tiny Llama through the Triton backend;
#   2. bench/bench_kernels.py: decode GB/s and % of peak (goal: >= 70% on an H200 at batch 64,
#      4k contexts), prefill TFLOP/s, both next to torch SDPA; JSON in bench/results/.
# Usage: bash bench/gpu_check.sh [extra bench_kernels.py arguments]
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
unset TRITON_INTERPRET  # the tests and the bench must compile the kernels, not interpret them

echo "== device"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv || true
"$PY" - <<'PYEOF'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device visible"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PYEOF

status=0
echo "== kernel tests on CUDA"
start=$SECONDS
timeout 230 "$PY" -m pytest tests/kernels -q -p no:cacheprovider || status=$?
echo "tests: exit $status in $((SECONDS - start)) s"

echo "== benchmark"
start=$SECONDS
timeout 200 "$PY" bench/bench_kernels.py "$@" || status=$?
echo "bench: done in $((SECONDS - start)) s"
exit "$status"
