#!/usr/bin/env bash
# A 15-minute loan (issue 36) runs benchmarks/gpu_loan.sh first (call1, call2: the headline, moeflow vs llama.cpp on
# a full-size model); the stages below come after it, in the order that script's header states.
#
# The GPU lane (issue 12): everything that needs a GPU, in stages that each end inside one 10-minute device command
# (every Python step runs under `timeout`, and writes its JSON under $OUT after every point it measures, so a run
# cut short still leaves numbers). Nothing here needs the network; the serve and peers stages need packages the lent
# machine lacks, carried as wheels (benchmarks/gpu_wheels.sh; without them those steps record the error).
#
# A lent GPU session (30 minutes of device time, the machine's start included) runs stages back to back (a machine
# left idle 30 s is given back, and the ~25 GB synthetic checkpoint in /tmp goes with it). Stages 1-3 ran on
# 2026-11-23 (H100: 2.3 + 0.75 + 4.8 min; benchmarks/results/h100-2026-11-23/). THE NEXT SESSION lent a GPU runs:
# correctness (the fixes since, CUDA graphs by default, the split-K fixup under real concurrency, the panel-major
# pool layouts), kernels (2: session 7's w13 split at T = 1 and session 8's panel layouts, timed beside the
# former row-major ones: panel_speedup in kernels.json, layouts in mxfp4.json), decode (3b), then peers-prep and peers (8, 9: first
# `bash benchmarks/peers/gpu_peer_sources.sh` and `bash benchmarks/gpu_wheels.sh` here, carry=[".peers/llama.cpp",
# ".whl"]), then serve (4, carry=[".whl"]: the server's decode passes as CUDA graphs, new in session 7); the one
# after: tune, engine, models, the families. The list in the order the stages were written:
#
#   1. bash benchmarks/run_all_gpu.sh correctness  # ~5-7 min (limits 45 + 470 s): the stack check (versions; stops
#                                                  #   at once naming a missing package or torch API:
#                                                  #   benchmarks/gpu/stack.py), then pytest -v -m cuda with the kernels
#                                                  #   compiled: AWQ kernels at Mixtral shapes and MXFP4 at gpt-oss-120b
#                                                  #   shapes (bf16) vs the fp32 reference, the race harness (NaN-
#                                                  #   poisoned evicted slots, delayed chunks; a deleted wait_event
#                                                  #   must be caught), every policy's tokens on streams, CUDA graphs
#   2. bash benchmarks/run_all_gpu.sh kernels      # ~8 min (limits 330 + 200 s): copy BW, cuBLAS peak, W4A16 MoE at
#                                                  #   Mixtral 8x7B/8x22B, T = 1..4096 under CUDA-graph replay vs bf16
#                                                  #   loop and int4pack_mm; then MXFP4 gpt-oss-120b experts, T = 1..512,
#                                                  #   % of HBM and x bf16 loop (gpu/mxfp4.py); both time the
#                                                  #   pool's panel-major weights beside the former row-major layout
#                                                  #   at decode T (outputs bitwise equal; session 8)
#   3. bash benchmarks/run_all_gpu.sh offload      # ~8 min (limit 510 s): writes the synthetic Mixtral-8x7B AWQ
#                                                  #   checkpoint (~25 GB, ~1-2 min), H2D bandwidth, resident + 5
#                                                  #   caching policies x 4 slot budgets, copy/compute trace
#   -- the next session (or this one with >= 10 min of device time left), same order:
#   3b. bash benchmarks/run_all_gpu.sh decode     # ~6-8 min (limits 390 + 150 s): steady-state decode of the stage-3
#                                                  #   checkpoint (rewritten first on a fresh machine: ~1-2 min),
#                                                  #   resident and lru at 128 / 64 slots, eager and as CUDA graphs:
#                                                  #   ms per step, host vs GPU ms per layer (issue 14); then
#                                                  #   cProfile of eager lru decode (benchmarks/gpu/host_profile.py)
#   4. bash benchmarks/run_all_gpu.sh serve        # ~4-6 min (limit 400 s); carry=[".whl"] after
#                                                  #   `bash benchmarks/gpu_wheels.sh` (fastapi, pydantic, uvicorn,
#                                                  #   openai: the machine lacks them). moeflow serve on the GPU
#                                                  #   (embedded model, resident + lru, 1 and 8 concurrent clients,
#                                                  #   decode passes eager and as CUDA graphs, every reply =
#                                                  #   generate's text)
#   4b. bash benchmarks/run_all_gpu.sh engine      # ~5-7 min (limit 370 s): cuda_graphs=True vs eager decode
#                                                  #   (resident, lru) and the disk tier (host_memory_gb, pinned rows,
#                                                  #   CUDA transport, tokens = in-RAM) on the stage-3 checkpoint
#                                                  #   (rewritten first on a fresh machine: ~1-2 min)
#   5. bash benchmarks/run_all_gpu.sh models       # ~9.5 min: predictive policies, cpu_compute auto, simulator check
#   6. bash benchmarks/run_all_gpu.sh families-qwen3   # ~6-9 min (issue 16): writes the synthetic Qwen3-30B-A3B
#                                                  #   AWQ checkpoint (48 layers, ~17 GB), decode tok/s at 4/8/12 GB
#                                                  #   x lru/mixtral-offloading/static x cpu_compute never/auto
#   7. bash benchmarks/run_all_gpu.sh families-gpt-oss # ~7-9 min (issue 18): a gpt-oss-120b-shaped MXFP4 checkpoint
#                                                  #   of 18 of its 36 layers (~33 GB: the full 61 GB does not fit
#                                                  #   the disk beside the others; per-layer times reported), 16/24 GB.
#                                                  #   Both delete the other synthetic checkpoints in /tmp when the
#                                                  #   disk is short (stages 3-5 then rewrite theirs: ~1-2 min).
#   8. bash benchmarks/run_all_gpu.sh peers-prep   # ~6-9 min (limit 570 s; issue 12 item 5); carry=
#                                                  #   [".peers/llama.cpp", ".whl"] after `bash benchmarks/peers/
#                                                  #   gpu_peer_sources.sh` and `bash benchmarks/gpu_wheels.sh` here (~24 MiB
#                                                  #   of llama.cpp sources): builds llama-bench + llama-quantize with
#                                                  #   CUDA (sm_90, no FA kernels, -j16) while it writes a 4-layer
#                                                  #   Mixtral-8x7B-shaped model (transformers, bf16, ~12 GB), converts
#                                                  #   it to GGUF, quantizes Q4_0 (~3.3 GB; the bf16 GGUF deleted) and
#                                                  #   AWQ (`moeflow quantize`, ~3.2 GB) in /tmp/moeflow-peers
#                                                  #   (~31 GB at the peak, 19 after: beside stage 3's 25 GB; the
#                                                  #   families' removed first if short, then stage 3's)
#   9. bash benchmarks/run_all_gpu.sh peers        # ~5-8 min (limit 560 s), right after 8 (same warm machine: its
#                                                  #   build and models are in /tmp; on a fresh one it redoes 8 first
#                                                  #   and may not finish): llama-bench -ngl 99 pp512/tg64 with
#                                                  #   --n-cpu-moe 0/2/3 vs moeflow resident / lru / lru+cpu_compute
#                                                  #   auto at the same experts on the GPU (32/16/8 slots) vs
#                                                  #   transformers+accelerate fp16 (device_map="auto", max_memory);
#                                                  #   moeflow/peer ratios in $OUT/peers/peers_gpu.{json,md}
#   optional: bash benchmarks/run_all_gpu.sh tune  # ~9 min: config sweep for T = 1, 4, 16 (writes $OUT/<gpu>.json;
#                                                  #   commit it as moeflow/kernels/experts/configs/<gpu>.json)
#   10. bash benchmarks/run_all_gpu.sh deltanet     # ~1-3 min (limit 260 s): one Qwen3-Next-80B Gated DeltaNet layer's
#                                                  #   core, torch vs Triton, CUDA-graph replay: decode 1/8/64 rows (% of
#                                                  #   copy BW), prefill 512/4k/32k (chunked torch vs the recurrence
#                                                  #   kernel), max abs diff per point ($OUT/deltanet.jsonl)
#   11. bash benchmarks/run_all_gpu.sh families-qwen3-next    # ~8-9.5 min: 24 of 48 layers (~23 GB AWQ experts), 8/12/16 GB
#   12. bash benchmarks/run_all_gpu.sh families-minimax-m2    # ~8-9.5 min: 10 of 62 layers (~22 GB), 8/12/16 GB
#   13. bash benchmarks/run_all_gpu.sh families-deepseek-v32  # ~8-9.5 min: 6 of 61 layers (3 dense + 3 MoE, ~26 GB), 12/16/20 GB
#   14. bash benchmarks/run_all_gpu.sh families-glm-5         # ~8-9.5 min: 6 of 78 layers (3 dense + 3 MoE, ~23 GB), 12/16/20 GB
#                                                  #   (10-14: session 10's writers and script, CPU-tested in TINY mode
#                                                  #   only; the slices' shapes checked against the published config
#                                                  #   files in session 11: benchmarks/results/family_shapes.md)
#   15. bash benchmarks/run_all_gpu.sh lookup       # ~1-3 min (limits 2 x 150 s): prompt lookup decoding against plain
#                                                  #   greedy on the embedded model in fp16, the verify passes replayed
#                                                  #   from CUDA graphs and then every pass eager ($OUT/lookup*.json)
#
# Device tool call: run(command="bash benchmarks/run_all_gpu.sh correctness", timeout_s=600). Stages 8-9, after
# `bash benchmarks/peers/gpu_peer_sources.sh` here, back to back: run(command="bash benchmarks/run_all_gpu.sh
# peers-prep", carry=[".peers/llama.cpp", ".whl"], timeout_s=600), then the same with `peers` (benchmarks/peers/README.md).
# Every measurement prints one line as it ends and is written to JSON under $OUT at once; a failing one is recorded
# and the stage goes on; every step runs under `timeout`. If a stage dies, its log is $OUT/<stage>.log. Results go to
# $OUT (else benchmarks/results/gpu-<date>/): copy them under benchmarks/results/<gpu>-<date>/ with a short table.
# Each stage leaves at most 8 files in $OUT, no deeper than one folder (the device tool's limits); Markdown tables and
# logs of `models` are packed into one .tgz.
# Every stage also runs on a CPU (`--tiny` / `--dry-run` sizes) with TINY=1: bash benchmarks/run_all_gpu.sh offload
# PLAN=1 prints each step's time limit and command and runs nothing (tests/test_gpu_lane_tiny.py sums the limits).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-$(command -v python3 || command -v python)}"  # the lent machine documents python3 (its torch venv)
out="${OUT:-benchmarks/results/gpu-$(date +%Y-%m-%d)}"
stage="${1:-}"
ckpt=(--checkpoint "${CKPT:-/tmp/moeflow-mixtral-8x7b-awq}")
tiny=()  # TINY=1: the CPU sizes; each script then writes its own tiny checkpoint (their layer counts differ)
if [ "${TINY:-0}" = 1 ]; then tiny=(--tiny); ckpt=(); fi
plan="${PLAN:-0}"
mkdir -p "$out"
[ "$plan" = 1 ] || {
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} > "$out/env-$stage.txt" 2>&1

run() {  # run <seconds> <log name> <command...>: bounded, logged, never aborting the stage
  local limit=$1 log=$2
  shift 2
  if [ "$plan" = 1 ]; then echo "plan $limit $*"; return 0; fi
  echo "== $(date -u +%T) $* (limit ${limit}s)" | tee -a "$out/$log"
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$out/$log"
  local rc=${PIPESTATUS[0]}
  echo "== rc=$rc" | tee -a "$out/$log"
  return 0
}

install_wheels() {  # install_wheels <log>: the wheels of benchmarks/gpu_wheels.sh, carried in .whl/ (no network
  # there): the server's packages for `serve`, sentencepiece for the peers' tokenizer. Installed into /tmp/site.
  if [ "${TINY:-0}" != 1 ] && [ "$plan" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 \
      | tail -3 | tee -a "$out/$1" && export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH#"$PWD"}" \
      && echo "== wheels of .whl/ installed in /tmp/site" | tee -a "$out/$1"
  fi
}

stack_check() {  # the stage's first step: the stack's versions, and a stop (exit 3) naming what a step would lack
  if [ "$plan" = 1 ]; then echo "plan 45 $py -m benchmarks.gpu.stack $*"; return 0; fi
  local cuda=(--cuda)
  if [ "${TINY:-0}" = 1 ]; then cuda=(); fi  # the CPU sizes: no device needed
  echo "== $(date -u +%T) stack check" | tee -a "$out/$stage.log"
  timeout --kill-after=5 45 "$py" -m benchmarks.gpu.stack "${cuda[@]}" "$@" 2>&1 | tee -a "$out/$stage.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "stage $stage stopped: stack check rc=$rc (above)" | tee -a "$out/$stage.log"; exit 3; }
}

case "$stage" in
  correctness)
    stack_check --pytest
    # the kernels compiled, not interpreted (tests/conftest.py sets TRITON_INTERPRET=1 only when it is unset);
    # -v: one line per test as it ends; a test stuck past 200 s fails alone where pytest-timeout is installed
    # and benchmarks/common/pytest_jsonl.py appends one JSON line per test as it ends to $out/pytest-cuda.jsonl
    per_test=() plugin=()
    if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 200); fi
    if "$py" -c "import benchmarks.common.pytest_jsonl" 2>/dev/null; then plugin=(-p benchmarks.common.pytest_jsonl); fi
    MOEFLOW_TEST_JSONL="$out/pytest-cuda.jsonl" TRITON_INTERPRET=0 run 470 correctness.log "$py" -m pytest -v -m cuda \
      -p no:cacheprovider "${plugin[@]}" --durations=15 "${per_test[@]}" --junitxml "$out/pytest-cuda.xml" \
      tests/test_cuda_lane.py tests/test_invariant.py tests/test_compile_cuda_graphs.py tests/test_serve_graphs.py \
      tests/test_cuda_mxfp4_splitk.py tests/test_cuda_panel_layout.py tests/test_cuda_deltanet.py \
      tests/test_cuda_slot_attention.py tests/test_cuda_latent_attention.py tests/test_lookup_graphs.py tests/test_engine_lookup_graphs.py \
      tests/test_cuda_gguf_kernels.py tests/test_cuda_device_graphs_formats.py ;;
  kernels)
    if [ "${TINY:-0}" = 1 ]; then
      run 300 kernels.log "$py" -m benchmarks.gpu.kernels --dry-run --out "$out/kernels.json"
      run 120 kernels.log "$py" -m benchmarks.gpu.mxfp4 --tiny --out "$out/mxfp4.json"
    else
      run 330 kernels.log "$py" -m benchmarks.gpu.kernels --shapes mixtral-8x7b,mixtral-8x22b \
        --out "$out/kernels.json" --budget-s 250
      # --splits: every (w13, w2) split at T <= 16 beside the wave rule's defaults (session 7; the T = 1 default
      # went from 180 w13 programs to 1440); the budget stops new points, so T = 512 may be cut (measured before)
      run 200 kernels.log "$py" -m benchmarks.gpu.mxfp4 --shapes gpt-oss-120b --splits --out "$out/mxfp4.json" \
        --budget-s 140
    fi ;;
  tune)
    run 560 tune.log "$py" -m benchmarks.gpu.kernels --shapes mixtral-8x7b --tokens 1,4,16 --skip-baselines \
      --quick --tune --tune-out "$out/tuned-configs.json" --out "$out/tune.json" --budget-s 480 ;;
  offload)
    run 510 offload.log "$py" -m benchmarks.gpu.offload "${tiny[@]}" "${ckpt[@]}" --out "$out/offload" \
      --time-budget-s 370 ;;
  decode)  # steady-state decode, eager and as CUDA graphs: host vs GPU ms per layer (issue 14), on stage 3's checkpoint
    run 390 decode.log "$py" -m benchmarks.gpu.decode_profile "${tiny[@]}" "${ckpt[@]}" --graphs --slots 128,64 \
      --out "$out/decode_profile.json"
    run 150 decode.log "$py" -m benchmarks.gpu.host_profile "${tiny[@]}" "${ckpt[@]}" --policy lru --slots 128 \
      --out "$out/host_profile_lru.txt" ;;
  serve)  # moeflow serve on the embedded model (no checkpoint needed): decode passes eager vs as CUDA graphs
    install_wheels serve.log  # the server's packages (else serve records the error)
    serve=(--out "$out/serve")
    if [ "${TINY:-0}" = 1 ]; then serve=(--tiny --out "$out/serve"); fi
    run 400 serve.log "$py" -m benchmarks.gpu.serve "${serve[@]}" ;;
  engine)  # CUDA graphs and the disk tier on the Mixtral checkpoint
    run 370 engine.log "$py" -m benchmarks.gpu.engine "${tiny[@]}" "${ckpt[@]}" --out "$out/engine" \
      --time-budget-s 290 ;;
  models)  # three scripts share the checkpoint (written by the first that finds none: ~1-2 min); each loads it
    run 265 models.log "$py" -m benchmarks.gpu.policies "${tiny[@]}" "${ckpt[@]}" \
      --out "$out/policies" --time-budget-s 200 --train-seconds 15 --trace-prompts 12
    run 125 models.log "$py" -m benchmarks.gpu.hybrid "${tiny[@]}" "${ckpt[@]}" --out "$out/hybrid" \
      --time-budget-s 80
    run 140 models.log "$py" -m benchmarks.gpu.sim_validation "${tiny[@]}" "${ckpt[@]}" --out "$out/sim" \
      --time-budget-s 80
    [ "$plan" = 1 ] || (cd "$out" && tar czf models-tables-logs.tgz policies/*.md hybrid/*.md sim/*.md models.log \
      2>/dev/null && rm -f policies/*.md hybrid/*.md sim/*.md models.log) ;;
  lookup)  # prompt lookup: captured verify step vs eager passes vs plain greedy (embedded model, no checkpoint)
    if [ "${TINY:-0}" = 1 ]; then
      run 150 lookup.log "$py" -m benchmarks.engine.prompt_lookup --repeats 1 --new-tokens 8 --lookups 2 \
        --out "$out/lookup.json"
    else
      run 150 lookup.log "$py" -m benchmarks.engine.prompt_lookup --device cuda --out "$out/lookup_graphs.json"
      run 150 lookup.log "$py" -m benchmarks.engine.prompt_lookup --device cuda --no-cuda-graphs \
        --out "$out/lookup_eager.json"
    fi ;;
  deltanet)  # one Qwen3-Next-80B Gated DeltaNet layer's core, torch vs Triton (no checkpoint; JSON lines as taken)
    dn=(--out "$out/deltanet.jsonl" --budget-s 200)
    if [ "${TINY:-0}" = 1 ]; then dn=(--tiny --out "$out/deltanet.jsonl"); fi
    run 260 deltanet.log "$py" -m benchmarks.gpu.deltanet "${dn[@]}" ;;
  families-qwen3|families-gpt-oss|families-qwen3-next|families-minimax-m2|families-deepseek-v32|families-glm-5)
    # one family per stage: each writes a ~17-33 GB checkpoint (write + load ~2-5 min)
    case "$stage" in
      families-qwen3) family=qwen3_moe need_gb=19 ;;
      families-gpt-oss) family=gpt_oss need_gb=36 ;;
      families-qwen3-next) family=qwen3_next need_gb=25 ;;
      families-minimax-m2) family=minimax_m2 need_gb=24 ;;
      families-deepseek-v32) family=deepseek_v32 need_gb=28 ;;
      families-glm-5) family=glm_moe_dsa need_gb=25 ;;
    esac
    own="/tmp/moeflow-synthetic-$family-"
    avail_gb=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
    if [ "${TINY:-0}" != 1 ] && [ "$plan" != 1 ] && [ "$avail_gb" -lt "$need_gb" ]; then
      for d in "${CKPT:-/tmp/moeflow-mixtral-8x7b-awq}" /tmp/moeflow-synthetic-*; do  # the 64 GiB disk: make room
        case "$d" in "$own"*) ;; *) [ -d "$d" ] && echo "removing $d (disk)" && rm -rf "$d" ;; esac
      done
    fi
    layers=()  # LAYERS=12: a smaller gpt-oss checkpoint (its MXFP4 load repacks ~0.03-0.3 s per expert on the CPU)
    if [ -n "${LAYERS:-}" ]; then layers=(--layers "$LAYERS"); fi
    run 570 "$stage.log" "$py" -m benchmarks.gpu.families --family "$family" "${tiny[@]}" "${layers[@]}" \
      --out "$out/families" --time-budget-s 450 ;;
  peers-prep|peers)  # issue 12 item 5: llama.cpp (CUDA) and transformers+accelerate vs moeflow on one model
    # (benchmarks/peers/README.md). TINY=1: a tiny model on the CPU with the CPU llama.cpp of build_llama_cpp.sh
    # at $LLAMA_CPP_BUILD (without one, llama.cpp is skipped with a message)
    peers=(--work "${PEERS_WORK:-/tmp/moeflow-peers}" --out "$out/peers")
    if [ "${TINY:-0}" = 1 ]; then
      peers=(--tiny --work "${PEERS_WORK:-/tmp/moeflow-peers-tiny}" --out "$out/peers"
             --llama-build "${LLAMA_CPP_BUILD:-/tmp/peers/llama.cpp/build}")
    elif [ "$plan" != 1 ]; then
      # the bf16 HF model and GGUF, Q4_0 and AWQ: ~31 GB at the peak (~19 GB after); the others go if short
      for d in /tmp/moeflow-synthetic-* "${CKPT:-/tmp/moeflow-mixtral-8x7b-awq}"; do
        avail_gb=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
        if [ "$avail_gb" -lt 34 ] && [ ! -d "${PEERS_WORK:-/tmp/moeflow-peers}/awq" ] && [ -d "$d" ]; then
          echo "removing $d (disk: ${avail_gb} GB free)" | tee -a "$out/peers.log" && rm -rf "$d"
        fi
      done
    fi
    install_wheels peers.log  # sentencepiece: the tokenizer llama.cpp's converter reads
    if [ "${PEERS_FA:-0}" = 1 ]; then peers+=(--flash-attn); fi  # llama.cpp's FA kernels too: ~+2 min of build
    if [ "$stage" = peers-prep ]; then
      run 570 peers.log "$py" -m benchmarks.peers.run_gpu_peers --phase prep "${peers[@]}"
    else  # prep again first: it skips what exists (a fresh machine redoes it all, in the same limit)
      run 560 peers.log "$py" -m benchmarks.peers.run_gpu_peers --phase all "${peers[@]}" --time-budget-s 400
    fi ;;
  *) echo "usage: $0 correctness|kernels|offload|decode|serve|engine|models|families-qwen3|families-gpt-oss|peers-prep|" \
       "peers|tune|deltanet|lookup|families-qwen3-next|families-minimax-m2|families-deepseek-v32|families-glm-5" \
       "(TINY=1: CPU sizes)" >&2
     exit 2 ;;
esac
[ "$plan" = 1 ] || echo "stage $stage done: $(ls -R "$out" | tr '\n' ' ')"
