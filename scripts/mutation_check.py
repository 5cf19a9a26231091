"""Mutation check: apply one deliberate single-line bug at a time to a copy of the repo; the named tests must fail.

Each mutation is (id, what it models, an exact code snippet, its replacement, the test node ids that must kill
it). The snippet is looked up anywhere under ``moeflow/``, so files may move; it must occur exactly once in the
whole package (the script stops with the id and the count otherwise: the guarded code moved or changed, and the
mutation must be updated with it). Every mutation runs ``--runs`` times (default 2) in a temporary copy
(``PYTHONPATH=<copy>``), reverted in between. Not part of the suite (slow); run it before closing an issue that
touches the guarded code, and record the table in docs/testing.md.

    python -m scripts.mutation_check                  # every mutation, twice
    python -m scripts.mutation_check --only fence-     # ids starting with "fence-"
    python -m scripts.mutation_check --list           # ids, what they model, where the snippet is now
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "moeflow"


@dataclass(frozen=True)
class Mutation:
    id: str
    models: str
    snippet: str
    replacement: str
    tests: tuple[str, ...]


FENCES = ("tests/test_fences.py",)
COUNTS = "tests/test_policy_counts.py"
BUCKETS = ("tests/test_compile_cuda_graphs.py::"
           "test_lengths_in_one_bucket_replay_one_capture_and_another_bucket_recaptures_into_a_fresh_pool",)
SPLITK = ("tests/test_splitk_fixup.py",)
MXFP4_SPLITK = ("tests/test_mxfp4_splitk.py",)
PANEL = ("tests/test_panel_layout.py",)
AUDIT_UNITS = "tests/test_audit_units.py::"
MUTATIONS = [
    # ---- ordering guards (scripted transport, tests/test_fences.py)
    Mutation("fence-engine-ignores-after", "the copy engine issues a batch without waiting for its tasks' after",
             "after.setdefault(id(h), h)", "pass", FENCES + ("tests/test_copy_batching.py",)),
    Mutation("fence-load-unfenced", "a load (needed, deferred ring load or prefetch) does not wait for its slot's "
             "fences", "after=fences, stats=stats,", "after=(), stats=stats,", FENCES),
    Mutation("fence-no-compute-fence", "a released slot forgets the compute that read it (next copy may overwrite "
             "it under the kernel)", "slot.fences = [fence]  # earlier fences precede this compute",
             "slot.fences = []  # earlier fences precede this compute", FENCES),
    Mutation("fence-early-group-unfenced", "an early group (hits launched before the read-back) leaves no fence on "
             "its slots", "pins unchanged.\"\"\"\n        slot.fences = [fence]",
             "pins unchanged.\"\"\"\n        slot.fences = []",
             ("tests/test_early_hits.py::test_the_fences_hold_with_the_early_group",)),
    Mutation("fence-drop-forgets-copies", "a cancelled load's in-flight copies are not kept as the slot's fences",
             "slot.fences = [*slot.fences, *fences]", "slot.fences = list(slot.fences)", FENCES),
    Mutation("fence-task-fences-omit-copies", "a task's fences omit its own issued copies",
             "return [h for h in (*self.after, *self.handles) if not h.query()]",
             "return [h for h in self.after if not h.query()]", FENCES),
    Mutation("fence-reclaim-unfenced", "a reclaimed prefetch slot is reused without waiting for the cancelled copies",
             "self.cache.drop(victim, self.engine.cancel(victim.task))",
             "self.cache.drop(victim, self.engine.cancel(victim.task) and [])", FENCES),
    Mutation("fence-preempt-unfenced", "a prefetch dropped at its gate leaves no fences on its slot",
             "self.cache.drop(self.cache.lookup(task.key), task.fences())",
             "self.cache.drop(self.cache.lookup(task.key), [])", FENCES),
    Mutation("fence-compute-no-wait", "compute does not wait for the copy it reads",
             "self.transport.wait_compute(task.handles)", "self.transport.wait_compute([])", FENCES),
    # ---- precision
    Mutation("kernel-half-accumulation", "the prefill GEMM rounds its accumulator to the activation dtype each k-step",
             "acc = tl.dot(a.to(CDTYPE).to(DOT_DTYPE), w.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)",
             "acc = tl.dot(a.to(CDTYPE).to(DOT_DTYPE), w.to(DOT_DTYPE), acc=acc, input_precision=DOT_PREC)"
             ".to(CDTYPE).to(tl.float32)",
             ("tests/test_kernel_precision.py",)),
    # ---- hit rates (pinned counts, tests/test_policy_counts.py)
    Mutation("lru-fresh-load-not-recent", "a fresh load is not counted as recent (LRU evicts a prefetch first)",
             "self.recency[key] = None\n        self.recency.move_to_end(key)\n",
             "self.recency[key] = None\n        self.recency.move_to_end(key, last=False)\n", (COUNTS,)),
    Mutation("lru-access-not-recent", "a gate access does not refresh recency",
             "        if key in self.recency:\n            self.recency.move_to_end(key)", "        pass", (COUNTS,)),
    Mutation("lfu-by-recency", "LFU evicts by recency only",
             "        for f in self._levels:  # lowest frequency first, oldest first within it\n"
             "            for key in self._buckets[f]:",
             "        for _f in (0,):\n            for key in self.recency:", (COUNTS,)),
    Mutation("static-evicts-fixed", "static evicts its fixed (popular) experts first",
             "        for key in self._ring:  # the streaming ring in LRU order",
             "        for key in [k for k in self.recency if k in self.fixed]:  # (mutant) the placement first",
             (COUNTS,)),
    Mutation("speculation-current-router", "mixtral-offloading speculates with the current layer's router",
             "probs, top, _ = self.route(_logits(self.gates[target], x))",
             "probs, top, _ = self.route(_logits(self.gates[layer], x))",
             (COUNTS,)),
    Mutation("speculation-least-likely", "mixtral-offloading prefetches the least likely experts (one token)",
             "ids = top[0]  # int32", "ids = torch.topk(probs[0], top.shape[-1], largest=False).indices  #",
             (COUNTS,)),
    Mutation("duoserve-ring-removed", "DuoServe's k-slot prefill ring removed (every miss loads at once)",
             "if ring and len(waiting) >= ring:", "if False:", (COUNTS,)),
    Mutation("finemoe-low-queue-fifo", "the low queue ignores the prefetch priority (FineMoE's p / (l - l_now))",
             "while i > 0 and self._low[i - 1].priority < task.priority:", "while False:", (COUNTS,)),
    Mutation("plec-misprefetched-not-first", "PLEC's correction replaces mis-prefetched experts after finished ones",
             "        if key in self.prefetched and key not in self.next_planned:\n            return (0,)",
             "        if key in self.prefetched and key not in self.next_planned:\n            return (2, 0)",
             ("tests/test_expertflow.py::test_plec_correction_order_misprefetched_before_finished",)),
    Mutation("plec-finished-by-first-use", "PLEC replaces the finished expert that comes back first, not last",
             "return (2, -(((layer - layer_now - 1) % L) + 1))", "return (2, ((layer - layer_now - 1) % L) + 1)",
             ("tests/test_expertflow.py::test_plec_finished_experts_by_next_use",)),
    # ---- claims
    Mutation("cpu-int4-repack-falls-back", "the fast AWQ->int4 repack silently falls back to torch's conversion",
             "_REPACK_BLOCK = next((b for b in (64, 32)", "_REPACK_BLOCK = 0 * next((b for b in (64, 32)",
             ("tests/test_claims.py::test_fast_int4_repack_is_the_path_taken",)),
    Mutation("chunks-unaligned", "copy chunks are not multiples of the pool alignment",
             "step = max(align, -(-nbytes // chunks // align) * align)",
             "step = max(align, -(-nbytes // chunks // align) * align) + 1",
             ("tests/test_scheduling_backend.py::test_random_delay_stats_bytes_are_chunk_multiples",)),
    # ---- GPU-only branches, run with CUDA's streams and events stood in for
    Mutation("readback-proposals-shifted", "the staged read-back splits the proposals one value late",
             "lists, at = [], E\n", "lists, at = [], E + 1\n",
             ("tests/test_cuda_paths_emulated.py::test_staged_read_back_equals_the_in_place_read",)),
    Mutation("pinned-ring-no-wait", "the pinned ring refills a host buffer before its last copy ran",
             "self.events[i].synchronize()", "pass",
             ("tests/test_cuda_paths_emulated.py::test_slot_tables_through_the_pinned_ring",)),
    Mutation("transport-waits-on-recycled", "the copy stream also waits on fences whose event was recycled",
             "if isinstance(h, CudaHandle) and h.current:", "if isinstance(h, CudaHandle):",
             ("tests/test_cuda_paths_emulated.py::test_cuda_transport_fences_stalls_and_stream_check",)),
    # ---- tokens that are not real
    Mutation("padding-routed", "padding and finished rows are routed like real tokens (they pull experts in)",
             "if real is None or real[0] is None or real[1] != x.shape[0]:",
             "if True or real is None or real[0] is None or real[1] != x.shape[0]:",
             ("tests/test_invariant_padding.py",
              "tests/test_engine_continuous.py::test_right_padding_of_short_chunks_reaches_no_expert")),
    Mutation("finished-rows-real", "generate feeds finished rows as real tokens",
             "running = ~loop.finished[:, None] if self.mask_finished and bool(done.any()) else self.ones",
             "running = self.ones",
             ("tests/test_invariant_padding.py::test_finished_rows_route_nothing",)),
    Mutation("finemoe-searches-padding", "FineMoE's semantic query holds the padding's embeddings",
             "pred.begin_iteration(embeds if real is None else embeds.index_select(0, real))",
             "pred.begin_iteration(embeds)",
             ("tests/test_invariant_padding.py::test_finemoe_searches_and_counts_real_tokens_only",)),
    # ---- the KV cache kept for the CUDA-graph decode step (tests/test_compile_cuda_graphs.py)
    Mutation("graphs-cache-exact-length", "the kept cache is not rounded up to its bucket (every other length "
             "captures again)", "max_len = cache_length(max_len, self.config.max_position_embeddings)", "pass",
             BUCKETS),
    Mutation("graphs-cache-any-batch", "the kept cache is reused for another batch size",
             "key = (batch, max_len, spec)", "key = (1, max_len, spec)",
             BUCKETS),
    Mutation("graphs-dead-pool", "a recapture reuses the capture (memory pool) whose graphs were just dropped "
             "(torch's allocator refused it on the H100)",
             "self._capture = self.capture_factory(embeds.device)",
             "self._capture = self._capture or self.capture_factory(embeds.device)",
             BUCKETS),
    Mutation("graphs-forward-evicts", "a forward() pass replaces the kept cache (the next generate captures again)",
             "self._runner.new_cache(b, t, reuse=False)", "self._runner.new_cache(b, t)",
             BUCKETS),
    # ---- the split-K fixup (the last program of a tile reduces; session 7): under the interpreter
    Mutation("splitk-no-reset", "the reducing program leaves its tile's counter set (a replay would reduce early)",
             "tl.store(cnt_ptr + pid, 0)", "pass", SPLITK + MXFP4_SPLITK),
    # ---- the panel-major AWQ qweight (session 8): the kernel must step from panel to panel by its stride
    Mutation("panel-stride-ignored", "the expert GEMM reads every K tile of a whole-panel config from the first panel",
             "w = tl.load(b_rows + (k0 // PANEL) * stride_bp + rj[None, :])", "w = tl.load(b_rows + rj[None, :])",
             PANEL),
    # ---- the survivors of issue 35's bug audit (tests/test_audit_*.py)
    Mutation("audit-prelude-renormalizes", "the captured routing launch renormalizes every router's top-k weights "
             "(renormalize= dropped: its default is True)",
             "renormalize=kernel_routing.renormalize)\n        proposals = self.predictor.propose(layer, x)",
             ")\n        proposals = self.predictor.propose(layer, x)",
             ("tests/test_audit_prelude.py",)),
    Mutation("audit-key-bucket-short", "a captured decode pass reads keys [0, max position) (the query's own key "
             "missing at a bucket's edge)", "key_bucket(int(pos.max()) + 1, self.cache.max_len)",
             "key_bucket(int(pos.max()), self.cache.max_len)",
             ("tests/test_audit_engine.py::test_captured_passes_across_the_256_key_bucket_give_the_eager_log_"
              "probabilities",)),
    Mutation("audit-stop-first-listed", "the reply is cut at the first listed stop string found, not the earliest "
             "in the text", "cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)",
             "cut = next((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), -1)",
             (AUDIT_UNITS + "test_the_text_is_cut_at_the_earliest_stop_string_not_the_first_listed",)),
    Mutation("audit-lru-layer-access-not-recent", "a gate access does not refresh LRU's per-layer order (per-layer "
             "quotas)", "super().access(key)\n        order = self._layer_recency.get(key[0])\n"
             "        if order is not None and key in order:\n            order.move_to_end(key)",
             "super().access(key)", (AUDIT_UNITS + "test_a_gate_access_makes_an_expert_recent_in_its_layers_order",
                         AUDIT_UNITS + "test_lru_picks_agree_with_the_last_use_order_over_random_traffic")),
    Mutation("audit-penalty-reply-only", "the repetition penalty covers the generated tokens only, not the prompt",
             "seen = torch.tensor([prompt_ids + generated], dtype=torch.long)",
             "seen = torch.tensor([generated], dtype=torch.long)",
             (AUDIT_UNITS + "test_the_repetition_penalty_covers_the_prompts_tokens",
              "tests/test_audit_engine.py::test_the_engines_repetition_penalty_covers_the_prompt_as_generate_does")),
    Mutation("audit-plan-no-linear-state", "the memory plan leaves out the linear-attention states (batch x "
             "kv_bytes_per_sequence)",
             "kv_cache=kv_cache_bytes(cfg, dtype, tokens, batch, kv_bytes_per_token) + batch * kv_bytes_per_sequence,",
             "kv_cache=kv_cache_bytes(cfg, dtype, tokens, batch, kv_bytes_per_token),",
             (AUDIT_UNITS + "test_a_hybrid_models_plan_holds_its_linear_attention_states",)),
    Mutation("audit-splitk-reverse-sum", "the split-K fixup sums the partials S-1..0 (tokens stay exact; the "
             "documented order breaks)", "for s in tl.static_range(SPLIT_K):  # fixed order",
             "for s in tl.static_range(SPLIT_K - 1, -1, -1):  # fixed order", ("tests/test_audit_kernels.py",)),
    # (a first-arriver reducer is not listed: the interpreter runs programs one at a time, so the last one to
    # reduce always sees every partial and the output is right; only the GPU test with real concurrency,
    # tests/test_cuda_lane.py section 5, can show it)
]


def locate(m: Mutation, root: Path) -> Path:
    """The one file under ``root/moeflow`` holding ``m.snippet`` exactly once (SystemExit otherwise)."""
    hits = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        n = path.read_text().count(m.snippet)
        hits += [path] * n
    if len(hits) != 1:
        where = ", ".join(str(p.relative_to(root)) for p in hits) or "nowhere"
        sys.exit(f"mutation {m.id!r}: its snippet occurs {len(hits)} times under {PACKAGE}/ ({where}); the guarded "
                 f"code moved or changed: update the snippet in scripts/mutation_check.py\n  snippet: {m.snippet!r}")
    return hits[0]


def copy_repo(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".hypothesis",
                                    "*.egg-info", ".venv", "build", "dist")
    shutil.copytree(ROOT, dst, ignore=ignore, dirs_exist_ok=True)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """(killed, short reason): the named tests run in the copy; killed when pytest reports failures or errors."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, "timeout"
    last = (proc.stdout.strip().splitlines() or ["?"])[-1]
    return proc.returncode != 0, last[:90]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="run the mutations whose id starts with one of these")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or any(m.id.startswith(p) for p in args.only)]
    if not chosen:
        sys.exit(f"no mutation id starts with {args.only}")
    where = {m.id: locate(m, ROOT) for m in chosen}  # fail fast, before any copy
    if args.list:
        for m in chosen:
            print(f"{m.id:32s} {where[m.id].relative_to(ROOT)}  {m.models}")
        return 0
    rows, survived = [], 0
    with tempfile.TemporaryDirectory(prefix="moeflow-mutation-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        for m in chosen:
            target = copy / where[m.id].relative_to(ROOT)
            original = target.read_text()
            results = []
            for _ in range(args.runs):
                target.write_text(original.replace(m.snippet, m.replacement))
                t0 = time.perf_counter()
                try:
                    killed, why = run_tests(copy, m.tests, args.timeout)
                finally:
                    target.write_text(original)
                results.append((killed, why, time.perf_counter() - t0))
                print(f"{m.id}: {'killed' if killed else 'SURVIVED'} in {results[-1][2]:.0f}s ({why})", flush=True)
            verdict = "killed" if all(k for k, _, _ in results) else "SURVIVED"
            survived += verdict != "killed"
            rows.append(f"| {m.id} | {m.models} | `{where[m.id].relative_to(ROOT)}` | "
                        f"{' / '.join('killed' if k else 'survived' for k, _, _ in results)} | "
                        f"{', '.join(f'`{t}`' for t in m.tests)} |")
    table = "\n".join([
        f"Mutation check of {datetime.date.today()} ({args.runs} runs each):", "",
        "| mutation | models | file | runs | killed by |", "|---|---|---|---|---|", *rows,
    ])
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    print(f"{len(chosen) - survived}/{len(chosen)} killed every time")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
