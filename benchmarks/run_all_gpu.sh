#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit one 10-minute device command.
#
#   bash benchmarks/run_all_gpu.sh tests     # CUDA tests: invariant on real streams, kernels at real shapes
#   bash benchmarks/run_all_gpu.sh kernels   # Triton MoE kernels vs HBM bandwidth and cuBLAS (< 8 min)
#   bash benchmarks/run_all_gpu.sh offload   # synthetic Mixtral-8x7B AWQ: H2D bandwidth, policies, memory, trace
#   bash benchmarks/run_all_gpu.sh hybrid    # cpu_compute never vs auto at 12 / 16 GB
#   bash benchmarks/run_all_gpu.sh sim       # simulator vs measured time per token
#   bash benchmarks/run_all_gpu.sh policies  # TTFT / time per token of every predictive policy, predictor overhead
#
# Results go to $OUT (the device tool's output folder) or benchmarks/results/gpu-<date>/; copy them under
# benchmarks/results/ with the GPU's name and the date, and add a short table. The synthetic checkpoint
# (~24.6 GB) is written to $CKPT once per machine and reused by the later stages while the machine lives.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results/gpu-$(date +%Y-%m-%d)}"
ckpt="${CKPT:-/tmp/moeflow-mixtral-8x7b-awq}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>/dev/null || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/versions.txt"
case "${1:-}" in
  tests)   python -m pytest -q -p no:cacheprovider tests/test_invariant.py tests/test_kernels.py \
             tests/test_kernels_ops.py tests/test_model_kernels.py tests/test_hybrid.py \
             tests/test_compile_cuda_graphs.py 2>&1 | tee "$out/pytest-gpu.log" ;;
  kernels) python benchmarks/run_gpu_kernels.py --out "$out/kernels.json" --budget-s 460 ;;
  offload) python benchmarks/run_gpu_offload.py --checkpoint "$ckpt" --out "$out/offload" --time-budget-s 420 ;;
  hybrid)  python benchmarks/run_gpu_hybrid.py --checkpoint "$ckpt" --out "$out/hybrid" --time-budget-s 420 ;;
  sim)     python benchmarks/run_gpu_sim_validation.py --checkpoint "$ckpt" --out "$out/sim" --time-budget-s 420 ;;
  policies) python benchmarks/run_gpu_policies.py --checkpoint "$ckpt" --out "$out/policies" --time-budget-s 420 ;;
  *) echo "usage: $0 tests|kernels|offload|hybrid|sim|policies" >&2; exit 2 ;;
esac
