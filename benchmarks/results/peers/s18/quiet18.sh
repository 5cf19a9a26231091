#!/usr/bin/env bash
# Quiet-machine measurements of session 18 (no helper working). T = the merged tree, B = main at the session's start (42d3e24).
set -u
T=${T:-/work/wt/int}; B=${B:-/work/main}
R=$T/benchmarks/results/peers/s18; mkdir -p $R
cd $T; export PYTHONPATH=$T
date; uptime; grep -m1 "model name" /proc/cpuinfo
# 1. the peer model: AWQ every large linear 4-bit (awq-qa), llama.cpp's own Q4_0 file, the 16-bit-attention default (awq)
for th in 1 2; do
  python -m benchmarks.peers.cpu_side_by_side --work /tmp/peers --threads $th --reps 5 \
    --trees "before=$B:awq-qa:auto" --trees "after=$T:awq-qa:auto" \
    --trees "before-gguf=$B:mixtral-synth-Q4_0.gguf:auto" --trees "after-gguf=$T:mixtral-synth-Q4_0.gguf:auto" \
    --trees "after-h4=$T:awq-qa:auto:4" \
    $([ $th = 2 ] && echo --trees after-default=$T:awq:auto) \
    --out $R/quiet_t${th} 2>&1 | tail -9
  date; uptime
done
# 2. Q4_K_M, same file both sides
python -m benchmarks.peers.cpu_side_by_side --work /tmp/kquant_peers --llama-bin /tmp/peers/llama.cpp/build/bin \
  --llama-gguf mixtral-synth-Q4_K_M.gguf --trees "before=$B:mixtral-synth-Q4_K_M.gguf:auto" \
  --trees "after=$T:mixtral-synth-Q4_K_M.gguf:auto" --threads 1 --reps 5 --out $R/quiet_q4_k_m_t1 2>&1 | tail -6
date; uptime
# 3. gpt-oss MXFP4 file (Q8_0 head)
G=gpt-oss-mxfp4-synth-L2-E8.gguf
python -m benchmarks.peers.cpu_side_by_side --work /tmp/s16_gpt_oss --llama-bin /tmp/peers/llama.cpp/build/bin \
  --llama-gguf $G --threads 1 --reps 5 --trees before=$B:$G:auto --trees after=$T:$G:auto \
  --out $R/quiet_gpt_oss_t1 2>&1 | tail -6
date; uptime
# 4. cold start: Q4_0 and Q4_K_M GGUF, before/after/huge pages off, llama.cpp mmap
python -m benchmarks.disk.cold_start_mapped --model /tmp/moeflow-synthetic-mixtral-8x7b-awq-L2-q4_0.gguf \
  --model /tmp/moeflow-mmap-s16-mixtral-8x7b-L2-Q4_K_M.gguf --llama-cpp /tmp/peers/llama.cpp/build/bin \
  --tree before=$B --tree after=$T --tree off=$T --tree-env off:MOEFLOW_HUGEPAGES=0 --modes mmap --repeats 2 \
  --out $T/benchmarks/results/cold_start/quiet-s18 2>&1 | tail -16
date; uptime
