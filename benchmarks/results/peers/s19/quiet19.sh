#!/usr/bin/env bash
# Quiet-machine measurements of session 19 (no helper working). T = the merged tree, B = main at the session's start (8e2604e).
set -u
T=${T:-/work/wt/int}; B=${B:-/work/main}
R=$T/benchmarks/results/peers/s19; mkdir -p $R
cd $T; export PYTHONPATH=$T
date; uptime; grep -m1 "model name" /proc/cpuinfo
# 1. the peer model, every large linear 4-bit (awq-qa): native loop on (default) / off, before, int4 head; llama.cpp Q4_0
for th in 1 2; do
  python -m benchmarks.peers.cpu_side_by_side --work /tmp/peers --threads $th --reps 5 \
    --trees "before=$B:awq-qa:auto" --trees "after=$T:awq-qa:auto" --trees "loop-off=$T:awq-qa:auto" \
    --tree-env "loop-off:MOEFLOW_NATIVE_LOOP=0" --trees "after-h4=$T:awq-qa:auto:4" \
    --trees "after-gguf=$T:mixtral-synth-Q4_0.gguf:auto" \
    $([ $th = 2 ] && echo --trees after-default=$T:awq:auto) \
    --out $R/quiet_t${th} 2>&1 | tail -9
  date; uptime
done
# 2. Q4_K_M, same file both sides: repack + loop (after), repack off, before
for th in 1 2; do
  python -m benchmarks.peers.cpu_side_by_side --work /tmp/kquant_peers --llama-bin /tmp/peers/llama.cpp/build/bin \
    --llama-gguf mixtral-synth-Q4_K_M.gguf --trees "before=$B:mixtral-synth-Q4_K_M.gguf:auto" \
    --trees "after=$T:mixtral-synth-Q4_K_M.gguf:auto" --trees "repack-off=$T:mixtral-synth-Q4_K_M.gguf:auto" \
    --tree-env "repack-off:MOEFLOW_GGUF_REPACK=0" --threads $th --reps 5 --out $R/quiet_q4_k_m_t$th 2>&1 | tail -6
  date; uptime
done
# 3. gpt-oss MXFP4 file (Q8_0 head)
G=gpt-oss-mxfp4-synth-L2-E8.gguf
python -m benchmarks.peers.cpu_side_by_side --work /tmp/s16_gpt_oss --llama-bin /tmp/peers/llama.cpp/build/bin \
  --llama-gguf $G --threads 1 --reps 5 --trees before=$B:$G:auto --trees after=$T:$G:auto \
  --out $R/quiet_gpt_oss_t1 2>&1 | tail -6
date; uptime
# 4. moeflow serve beside llama-server, one streaming client
python -m benchmarks.peers.serve_side_by_side --threads 1 2 --reps 5 --tokens 96 --out $R/quiet_serve 2>&1 | tail -12
date; uptime
# 5. cold start of the Q4_K_M slice: repack on / off, llama.cpp mmap
python -m benchmarks.disk.cold_start_mapped --model /tmp/moeflow-mmap-s16-mixtral-8x7b-L2-Q4_K_M.gguf \
  --llama-cpp /tmp/peers/llama.cpp/build/bin --tree before=$B --tree after=$T --tree repack-off=$T \
  --tree-env repack-off:MOEFLOW_GGUF_REPACK=0 --modes mmap --repeats 2 \
  --out $T/benchmarks/results/cold_start/quiet-s19 2>&1 | tail -12
date; uptime
