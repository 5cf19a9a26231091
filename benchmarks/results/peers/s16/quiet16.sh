#!/usr/bin/env bash
# Quiet-machine measurements of session 16 (no helper working). T = the merged tree, B = main before the session.
set -u
T=${T:-/work/wt/int}; B=${B:-/work/wt/omp-before}
R=$T/benchmarks/results/peers/s16
cd $T; export PYTHONPATH=$T
date; uptime; grep -m1 "model name" /proc/cpuinfo
for th in 1 2; do
  python -m benchmarks.peers.cpu_side_by_side --work /tmp/peers --threads $th --reps 5 \
    --trees "before=$B:awq-qa:auto" --trees "after=$T:awq-qa:auto" \
    --trees "before-gguf=$B:mixtral-synth-Q4_0.gguf:auto" --trees "after-gguf=$T:mixtral-synth-Q4_0.gguf:auto" \
    --out $R/quiet_t${th} 2>&1 | tail -9
  date; uptime
done
python -m benchmarks.peers.cpu_side_by_side --work /tmp/kquant_peers --llama-bin /tmp/peers/llama.cpp/build/bin \
  --llama-gguf mixtral-synth-Q4_K_M.gguf --trees "before=$B:mixtral-synth-Q4_K_M.gguf:auto" \
  --trees "after=$T:mixtral-synth-Q4_K_M.gguf:auto" --threads 1 --reps 5 --out $R/quiet_q4_k_m_t1 2>&1 | tail -6
date; uptime
python -m benchmarks.peers.gpt_oss_mxfp4_cpu --work /tmp/s16_gpt_oss --threads 1 --reps 5 --out $R/quiet_gpt_oss_t1 2>&1 | tail -6
date; uptime
python -m benchmarks.disk.cold_start_mapped --model /tmp/moeflow-synthetic-mixtral-8x7b-awq-L2-q4_0.gguf \
  --model /tmp/moeflow-mmap-s16-mixtral-8x7b-L2-Q4_K_M.gguf --model /tmp/moeflow-synthetic-mixtral-8x7b-awq-L2 \
  --llama-cpp /tmp/peers/llama.cpp/build/bin --repeats 2 --out $T/benchmarks/results/cold_start/quiet-s16 2>&1 | tail -12
date; uptime
