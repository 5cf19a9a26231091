#!/usr/bin/env bash
# One 15-minute GPU loan, one headline (issue 36): moeflow against llama.cpp `--n-cpu-moe` decode tok/s on a full-size
# Mixtral-8x7B-shaped model, in at most TWO device commands (machine start ~1.5 min; at most 10 min per command).
#
# Before the loan, here (PyPI reachable): `bash benchmarks/gpu_wheels.sh` (.whl/: gguf for the GGUF writer, and the
# serve stage's packages) and `mkdir -p .peers && cp ../shared/peers/llama-cpp-cuda-sm90.tar.xz .peers/` (the
# prebuilt llama.cpp, CUDA sm_90 + CPU backends; ../shared/peers/README.md). Then:
#   run(command="bash benchmarks/gpu_loan.sh call1", carry=[".whl", ".peers/llama-cpp-cuda-sm90.tar.xz"], timeout_s=600)
#   run(command="bash benchmarks/gpu_loan.sh call2", carry=[".whl", ".peers/llama-cpp-cuda-sm90.tar.xz"], timeout_s=360)
#   give_back()
# The 15 minutes: start ~90 s + call 1 (its limits: <= 530 s) + call 2 (<= 300 s) = 920 s at the limits, plus the
# tree's transfers: call 2 gets what is left (~4-4.5 min after a call 1 that runs to its limits; `run` caps timeout_s
# at the device time left and returns what $OUT holds), so its steps go in priority order, the Qwen3 moeflow rows
# last. Call 2 must start within the machine's 30 s warm window (H200: "warm after a call 30 s"): a fresh machine
# has neither call 1's GGUF file nor its JSON in /tmp, and a second start costs ~90 s that is not there.
#
#   call1 (limits sum to <= 9 min): stack check (versions; the prebuilt llama.cpp's --list-devices must show CUDA0
#         with cuBLAS from torch's nvidia wheel on LD_LIBRARY_PATH; the compat libstdc++ is tried when it fails to
#         start, and a CUDA-less listing is recorded: the llama rows then say so and the fallback is
#         `run_all_gpu.sh peers-prep`, a later loan); the Mixtral AWQ checkpoint and its Q4_0 GGUF written in the
#         background meanwhile; the minimum correctness set (compiled kernels vs the fp32 reference at Mixtral
#         shapes incl. the split-K fixup, the panel layouts, the race harness with a deleted wait caught, CUDA-graph
#         decode tokens = eager); the kernels at T = 1, 4, 16 (% of the copy bandwidth measured in the same run,
#         panel vs row-major); llama-bench -ngl 99 --n-cpu-moe k -p 512 -n 64 at 50 % / 25 % / 100 % of the experts
#         on the GPU (moeflow's process does not exist yet); moeflow on the same weights loaded once: resident, lru
#         and lru + cpu_compute="auto" at 50 % and 25 %, CUDA graphs, 64 tokens after a 512-token prompt; the table.
#   call2 (limits sum to <= 5 min; right after call 1 on the same warm machine): first moeflow on the very Q4_0 GGUF
#         file call 1's llama.cpp rows ran (`from_pretrained(<file>.gguf)`: its Q4_0 experts load as AWQ with group
#         32, exactly the file's weights; same file, same bytes; rows "moeflow GGUF-Q4_0 ..." at the same shares,
#         each also marked whether its tokens equal the AWQ checkpoint's resident tokens; 100 s: the load, ~10x
#         slower per expert than the AWQ checkpoint's on the CPU, then the rows until its deadline), with call 1's
#         JSON carried over in /tmp (the device empties $OUT between commands), so call 2's headline_mixtral.json
#         holds every Mixtral row and ratio; then the Mixtral files are deleted (the 64 GiB disk) and the same
#         llama.cpp and moeflow rows run for the Qwen3-30B-A3B shape (48 layers, 128 experts, top 8) in what is left.
#
# Every step runs under `timeout` and checks its own deadline before each row; every point is written to JSON at
# once, so a command killed at its limit still returns what it measured. PLAN=1 prints each step's limit and command
# and runs nothing; TINY=1 runs it all on the CPU with tiny shapes, the CPU backends of the same prebuilt llama.cpp
# and the same GGUF writer (tests/test_gpu_loan.py runs both).
#
# Results: $OUT (the device's folder that comes back), else benchmarks/results/<gpu>-<date>/ (e.g. h200-2026-12-01:
# benchmarks.gpu.headline_report.results_dir). Copy the returned files there and commit: headline_mixtral.json (call
# 2's: a superset of call 1's), headline_qwen3.json, kernels.json, pytest-cuda.jsonl, stack.txt, call1.log /
# call2.log, and headline.md, the short table (`python -m benchmarks.gpu.headline_report <folder>` rewrites it from
# the JSON).
#
# Not in this loan (measured here on the CPU; they would not fit its 15 minutes beside the headline):
#   * the GGUF expert kernels compiled (tests/test_cuda_gguf_kernels.py: Q4_0, Q8_0, Q4_K + Q4_K_M's two-type down,
#     Q6_K + Q5_K at Qwen3-30B-A3B shapes, decode split-K and prefill vs the fp32 reference; 24 kernel compiles,
#     ~40-60 s from the AWQ kernels' 1-2 s per compile on the 2026-11-23 H100; call 1 has ~10 s spare and call 2
#     none) and llama.cpp vs moeflow on one Q4_K_M file: the `gguf` command below, the first later loan, run as
#     run(command="bash benchmarks/gpu_loan.sh gguf", carry=[".whl", ".peers/llama-cpp-cuda-sm90.tar.xz"],
#     timeout_s=600). Its file is written without a bf16 model and without llama-quantize (gguf_checkpoint's
#     experts="Q4_K_M": llama-quantize's Q4_K_M expert mixture, gate / up Q4_K, down Q6_K in its use_more_bits
#     layers else Q4_K, as random blocks; bound by the disk like the Q4_0 file). `llama-quantize --allow-requantize
#     <Q4_0> <out> Q4_K_M` from the prebuilt makes the same mixture but took 190 CPU-s for the 2-layer full-width
#     slice here (2 threads, load average ~9): ~3000 CPU-s for 32 layers, 3-4 min of the device's 16 cores.
#     moeflow's GGUF experts are captured with offload (ExpertFormat.captured_forward) and have CPU kernels
#     (kernels/cpu/gguf.c, gguf_k.c: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), so its cpu_compute="auto" rows run (session 15).
#
# Later loans, in this order (benchmarks/run_all_gpu.sh stages, after this script's `gguf`; the owed list in
# docs/status.md is the record):
#   gguf, serve, engine, models, families, tune, deltanet, lookup.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-$(command -v python3 || command -v python)}"
call="${1:-}"
plan="${PLAN:-0}"
tiny=()
if [ "${TINY:-0}" = 1 ]; then tiny=(--tiny --layers 4); fi
if [ -z "${OUT:-}" ] && [ "$plan" != 1 ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  OUT=$("$py" -c "import sys, time; from benchmarks.gpu import headline_report; \
print(headline_report.results_dir(sys.argv[1] or 'cpu', time.strftime('%Y-%m-%d', time.gmtime())))" "$gpu")
fi
out="${OUT:-benchmarks/results/plan}"
[ "$plan" = 1 ] || mkdir -p "$out"
log="$out/$call.log"
keep="${TMPDIR:-/tmp}/moeflow-loan"  # call 1's JSON for call 2 (outside $OUT, which the device empties)
t0=$(date +%s)

run() {  # run <seconds> <command...>: bounded, logged, never aborting the call
  local limit=$1
  shift
  if [ "$plan" = 1 ]; then echo "plan $limit $*"; return 0; fi
  echo "== $(date -u +%T) +$(( $(date +%s) - t0 ))s $* (limit ${limit}s)" | tee -a "$log"
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
  echo "== rc=${PIPESTATUS[0]}" | tee -a "$log"
}

background() {  # background <seconds> <command...>: started now, waited for by `wait_background`
  local limit=$1
  shift
  if [ "$plan" = 1 ]; then echo "plan-background $limit $*"; return 0; fi
  echo "== $(date -u +%T) +$(( $(date +%s) - t0 ))s background: $* (limit ${limit}s)" | tee -a "$log"
  (timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$call-background.log" 2>&1;
   echo "== background rc=$?" >> "$out/$call-background.log") &
  bg_pid=$!
}

wait_background() {
  [ "$plan" = 1 ] && return 0
  wait "$bg_pid"
  cat "$out/$call-background.log" >> "$log" && rm -f "$out/$call-background.log"
  echo "== $(date -u +%T) +$(( $(date +%s) - t0 ))s background done" | tee -a "$log"
}

stack() {  # versions, the device, the stack check, the prebuilt llama.cpp's devices: $out/stack.txt. At most 40 s:
  # the wheels 10 (~3 s), the stack check 20 (15 s on the 2026-11-23 H100, cold), llama.cpp unpacked + listed 10 (~6 s
  # on 2 loaded cores here); informative only (nothing below depends on it: the llama phase lists devices itself)
  if [ "$plan" = 1 ]; then echo "plan 40 $py -m benchmarks.gpu.stack --cuda --pytest; llama_cpp_prebuilt.py"; return 0; fi
  if [ "${TINY:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then  # gguf (and the serve stage's packages)
    timeout 10 "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  local cuda=(--cuda --pytest)
  if [ "${TINY:-0}" = 1 ]; then cuda=(); fi
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
      || echo "no nvidia-smi"; grep -m1 "model name" /proc/cpuinfo; nproc; free -g | sed -n 2p; df -h /tmp | tail -1
    timeout --kill-after=2 20 "$py" -m benchmarks.gpu.stack "${cuda[@]}" 2>&1
    timeout --kill-after=2 10 "$py" -m benchmarks.peers.llama_cpp_prebuilt 2>&1 | tail -25; } > "$out/stack.txt" 2>&1
  tee -a "$log" < "$out/stack.txt"
}

headline() {  # headline <family> <phase> <limit> [deadline [args...]]: one phase of gpu/headline.py in its own process
  local family=$1 phase=$2 limit=$3 deadline=${4:-$3}
  shift $(( $# < 4 ? $# : 4 ))
  run "$limit" "$py" -m benchmarks.gpu.headline --family "$family" --phase "$phase" "${tiny[@]}" \
    --out "$out" --deadline-s "$deadline" "$@"
}

keep_json() {  # call 1's Mixtral JSON for call 2, after each of its steps (a command cut short keeps what it has)
  [ "$plan" = 1 ] || { mkdir -p "$keep" && cp "$out/headline_mixtral.json" "$keep/" 2>/dev/null; }
  return 0
}

case "$call" in
  call1)
    stack
    if [ "${TINY:-0}" = 1 ]; then  # the scripts' own CPU sizes
      background 120 "$py" -m benchmarks.gpu.headline --family mixtral --phase checkpoints "${tiny[@]}" --out "$out"
    else
      background 200 "$py" -m benchmarks.gpu.headline --family mixtral --phase checkpoints --out "$out"
    fi
    per_test=() collect=()
    # the minimum set (22 tests; ~100 s of the 32 the H100 ran in 107 s on 2026-11-23): compiled AWQ kernels vs the
    # fp32 reference at Mixtral shapes T = 1..16 and the attention shape, the split-K fixup, the panel layouts, the race
    # harness (lru, eager and captured device part; a deleted wait caught), CUDA-graph decode tokens = eager
    min_set="not gpt_oss and not mxfp4 and not every_policy and not 512 and not 64 and not ondemand and not offloading"
    min_set+=" and not finemoe and not expertflow"
    if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 60); fi
    # TINY: the selection only collected (its tests are cuda-marked: they skip on a CPU; the CPU suite runs their
    # CPU twins), so a renamed or deleted test shows here
    if [ "${TINY:-0}" = 1 ]; then collect=(--collect-only -q); fi
    MOEFLOW_TEST_JSONL="$out/pytest-cuda.jsonl" TRITON_INTERPRET=0 run 90 "$py" -m pytest -v -m cuda \
      -p no:cacheprovider -p benchmarks.common.pytest_jsonl "${per_test[@]}" "${collect[@]}" -k "$min_set" \
      tests/test_cuda_lane.py tests/test_cuda_panel_layout.py tests/test_compile_cuda_graphs.py
    if [ "${TINY:-0}" = 1 ]; then  # (tests/test_kernels_ops.py runs its --dry-run)
      [ "$plan" = 1 ] || echo "kernels: not run with TINY=1" | tee -a "$log"
    else
      run 50 "$py" -m benchmarks.gpu.kernels --shapes mixtral-8x7b --tokens 1,4,16 --skip-baselines --quick \
        --out "$out/kernels.json" --budget-s 35
    fi
    wait_background
    headline mixtral llama 100 75
    keep_json
    headline mixtral moeflow 220 195
    keep_json
    run 10 "$py" -m benchmarks.gpu.headline_report "$out" ;;
  call2)
    # moeflow on the very Q4_0 GGUF call 1's llama.cpp rows ran (call 1 left it, and its JSON, in /tmp on this warm
    # machine; the device empties $OUT between commands)
    if [ "$plan" != 1 ] && [ -f "$keep/headline_mixtral.json" ] && [ ! -f "$out/headline_mixtral.json" ]; then
      cp "$keep/headline_mixtral.json" "$out/"
    fi
    headline mixtral moeflow 100 80 --source gguf
    [ "$plan" = 1 ] || [ "${TINY:-0}" = 1 ] || rm -rf /tmp/moeflow-headline-mixtral-*  # the disk: 64 GiB
    headline qwen3 checkpoints 75
    headline qwen3 llama 55 40
    headline qwen3 moeflow 60 45
    run 10 "$py" -m benchmarks.gpu.headline_report "$out" ;;
  gguf)  # a later loan's command (<= 9 min): the GGUF kernels compiled, then the same file's Q4_K_M rows
    stack
    background 150 "$py" -m benchmarks.gpu.headline --family mixtral --phase checkpoints --experts Q4_K_M \
      "${tiny[@]}" --out "$out"
    collect=()
    if [ "${TINY:-0}" = 1 ]; then collect=(--collect-only -q); fi
    MOEFLOW_TEST_JSONL="$out/pytest-cuda-gguf.jsonl" TRITON_INTERPRET=0 run 120 "$py" -m pytest -v -m cuda \
      -p no:cacheprovider -p benchmarks.common.pytest_jsonl "${collect[@]}" tests/test_cuda_gguf_kernels.py
    wait_background
    headline mixtral llama 100 75 --experts Q4_K_M
    headline mixtral moeflow 200 175 --source gguf --experts Q4_K_M
    run 10 "$py" -m benchmarks.gpu.headline_report "$out" ;;
  *) echo "usage: $0 call1|call2|gguf (PLAN=1: the plan; TINY=1: CPU sizes)" >&2; exit 2 ;;
esac
[ "$plan" = 1 ] || echo "$call done in $(( $(date +%s) - t0 )) s: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
