"""The GPU lane's newer scripts run end to end in their --tiny CPU modes (MXFP4 kernel timing, CUDA graphs and the
disk tier, `moeflow serve`), keep going past a failing measurement, and the stages' time limits fit the device
tool's budget (benchmarks/run_all_gpu.sh with PLAN=1 prints each step's limit and runs nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

COMMAND_LIMIT_S = 600  # one device command
SESSION_S = 30 * 60  # device time of one session, the machine's start included


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_run_gpu_mxfp4_tiny(tmp_path):
    from benchmarks.gpu import mxfp4 as run_gpu_mxfp4

    out = tmp_path / "mxfp4.json"
    report = run_gpu_mxfp4.main(["--tiny", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["T"] for r in saved["results"]] == [1, 4, 16] == [r["T"] for r in report["results"]]
    for r in saved["results"]:
        assert "error" not in r, r
        assert r["ours_s"] > 0 and r["frac_of_copy_bw"] > 0 and r["speedup_vs_loop"] > 0
        assert r["experts_used"] <= 8 and r["weight_bytes"] == r["experts_used"] * r["expert_bytes"]
        assert r["all_finite"] and r["rel_err_vs_fp32"] < 1e-2  # bf16 activations against the fp32 reference
        assert "Triton kernels" in r["layouts"]["skipped"]  # the layout A/B needs them (the torch backend here)
    assert "| tiny | 16 |" in out.with_suffix(".md").read_text()


def test_run_gpu_mxfp4_times_the_triton_kernels_and_survives_a_failing_point(tmp_path, monkeypatch):
    from benchmarks.gpu import mxfp4 as run_gpu_mxfp4

    real = run_gpu_mxfp4.bench_point

    def failing_at_4(name, T, *args):
        if T == 4:
            raise RuntimeError("out of memory (planted)")
        return real(name, T, *args)

    monkeypatch.setattr(run_gpu_mxfp4, "bench_point", failing_at_4)
    out = tmp_path / "mxfp4.json"
    run_gpu_mxfp4.main(["--tiny", "--interpret", "--tokens", "1,4,16", "--skip-baselines", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["T"] for r in results] == [1, 4, 16]
    assert "planted" in results[1]["error"] and "error" not in results[2]
    for r in (results[0], results[2]):  # the interpreted kernels (bf16 through fp32) against the fp32 reference
        assert r["backend"] == "triton" and r["rel_err_vs_fp32"] < 2e-2
        lay = r["layouts"]  # the K-panel pool and its row-major copy through the same kernels: the same bits
        assert lay["bitwise_equal"] and lay["panel"]["ours_s"] > 0 and lay["row_major"]["ours_s"] > 0
        assert lay["row_major_over_panel"] == lay["row_major"]["ours_s"] / lay["panel"]["ours_s"]
    assert "| row-major / panels |" in out.with_suffix(".md").read_text()


def test_run_gpu_engine_tiny(tmp_path, keep_threads):
    from benchmarks.gpu import engine as run_gpu_engine

    result = run_gpu_engine.main(["--tiny", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                                  "--new-tokens", "4", "--prompt-len", "6"])
    runs = result["runs"]
    assert all("error" not in r for r in runs), runs
    assert [(r["section"], r["policy"], r.get("mode")) for r in runs] == [
        ("cuda_graphs", "resident", "eager"), ("cuda_graphs", "resident", "cuda_graphs"),
        ("cuda_graphs", "resident", "cuda_graphs_experts_eager"),
        ("cuda_graphs", "lru", "eager"), ("cuda_graphs", "lru", "cuda_graphs"),
        ("cuda_graphs", "lru", "cuda_graphs_experts_eager"), ("disk", "lru", None), ("disk", "lru", None)]
    graphs = [r for r in runs if r.get("mode", "").startswith("cuda_graphs")]
    assert all(r["tokens_equal_eager"] and r["tokens_equal_resident"] is not False for r in graphs)
    lru = graphs[2]  # the offloading backend is captured piecewise (the CPU stand-in for CUDA graphs)
    assert lru["refused"] is None and lru["captures"] == 1 and lru["captures_during_timed_run"] == 0
    assert lru["pieces"] == result["config"]["num_hidden_layers"] + 1
    # the memory plan's pool estimate for the steps captured (the device's growth is measured on a GPU only)
    captured = [r for r in graphs if r["refused"] is None]
    assert captured and all(r["graph_steps"] == 1 and r["graph_pool_estimate_bytes"] >= 2**21 for r in captured)
    assert all(r["reserved_growth_bytes"] is None and r["pool_estimate_covers"] is None for r in graphs)
    disk = [r for r in runs if r["section"] == "disk"]
    assert all(r["on_disk"] and r["tokens_equal_in_ram_lru"] and r["tokens_equal_resident"] for r in disk)
    assert disk[0]["host_experts"] < disk[1]["host_experts"] < 16 and disk[0]["disk_bytes"] > 0
    saved = json.loads((tmp_path / "out" / "engine_results.json").read_text())
    assert len(saved["runs"]) == 8 and "| disk | lru | 5 |" in (tmp_path / "out" / "engine_results.md").read_text()


def test_run_gpu_serve_tiny(tmp_path):
    from benchmarks.gpu import serve as run_gpu_serve

    result = run_gpu_serve.main(["--tiny", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["config"], r.get("clients")) for r in rows] == [
        ("resident", 1), ("resident", 3), ("lru:8", 1), ("lru:8", 3)]
    assert all("error" not in r for r in rows), rows
    # continuous batching and offloading in the server keep generate's greedy text, reply by reply
    assert all(r["replies_equal_generate"] == r["requests"] == 3 and r["tokens_per_s"] > 0 for r in rows), rows
    # the CPU decodes eagerly (the server says so in /metrics); a GPU adds each level with --cuda-graphs on
    assert all(r["cuda_graphs"] == "off" and r["graphs_state"] == "off" and r["graph_captures"] == 0 for r in rows)
    saved = json.loads((tmp_path / "serve_results.json").read_text())
    assert saved["single_stream_tokens_per_s"] > 0 and saved["graphs_vs_eager"] == []


def test_run_gpu_serve_pairs_each_graphs_level_with_its_eager_level():
    from benchmarks.gpu import serve as run_gpu_serve

    def row(graphs, clients, tok_s, texts, **extra):
        return {"config": "lru:8", "cuda_graphs": graphs, "clients": clients, "tokens_per_s": tok_s,
                "texts": texts, "graphs_state": graphs, **extra}

    rows = [row("off", 1, 10.0, {"0": ["a"]}), row("off", 8, 40.0, {"0": ["a"], "1": ["b"]}),
            row("on", 1, 50.0, {"0": ["a"]}), row("on", 8, 80.0, {"0": ["a"], "1": ["c"]}),
            {"config": "resident", "cuda_graphs": "on", "clients": 1, "error": "planted"}]
    pairs = run_gpu_serve.graphs_vs_eager(rows)
    assert [(p["clients"], p["speedup"], p["replies_equal_eager"]) for p in pairs] == [(1, 5.0, True), (8, 2.0, False)]


def stage_plan(stage: str, tmp_path: Path) -> list[int]:
    env = {**os.environ, "PLAN": "1", "OUT": str(tmp_path / stage)}
    env.pop("TINY", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all_gpu.sh"), stage], env=env, text=True,
                          capture_output=True, check=True)
    return [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("plan ")]


def test_every_stage_fits_one_command_and_the_first_three_one_session(tmp_path):
    stages = ("correctness", "kernels", "offload", "decode", "serve", "engine", "models", "families-qwen3",
              "families-gpt-oss", "peers-prep", "peers", "tune", "deltanet", "families-qwen3-next",
              "families-minimax-m2", "families-deepseek-v32", "families-glm-5", "lookup")
    limits = {stage: stage_plan(stage, tmp_path) for stage in stages}
    assert all(limits.values()), limits
    # each step may run 15 s past its limit (timeout's --kill-after) and the stage starts with an env probe
    for stage, steps in limits.items():
        assert sum(steps) + 15 * len(steps) + 10 <= COMMAND_LIMIT_S, (stage, steps)
    first_session = sum(sum(limits[s]) for s in ("correctness", "kernels", "offload"))
    assert first_session <= SESSION_S - 4 * 60, limits  # ~2 min machine start, transfers and idle gaps
    header = (ROOT / "benchmarks" / "run_all_gpu.sh").read_text().split("set -uo pipefail")[0]
    order = [header.index(f"run_all_gpu.sh {s} ") for s in stages]
    assert order == sorted(order), "the header lists the stages in the order a session runs them"


def test_freeing_the_loaders_backend_keeps_the_shared_host_store_pinned():
    """The backend from_pretrained built owns the host store and unregisters its pages on close; the benchmarks
    swap backends over that store, so ``_free`` registers them again (else later policies copy from pageable
    memory on a GPU)."""
    from types import SimpleNamespace

    from benchmarks.gpu import offload as run_gpu_offload

    host = SimpleNamespace(pinned=True, pins=0)

    def pin():
        host.pinned, host.pins = True, host.pins + 1

    host.pin = pin
    owner = SimpleNamespace(host=host, close=lambda: setattr(host, "pinned", False))
    sharer = SimpleNamespace(host=host, close=lambda: None)  # owns_host=False: leaves the store alone
    model = SimpleNamespace(experts=owner, device=torch.device("cpu"), use_backend=lambda b: None)
    run_gpu_offload._free(model)
    assert host.pinned and host.pins == 1
    model.experts = sharer
    run_gpu_offload._free(model)
    assert host.pinned and host.pins == 1


def test_the_correctness_stage_writes_one_json_line_per_test_as_it_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no device')\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\ndef test_skipped():\n    pass\n"
        "def test_setup_fails(broken):\n    pass\n")
    jsonl = tmp_path / "out.jsonl"
    env = {**os.environ, "MOEFLOW_TEST_JSONL": str(jsonl), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "benchmarks.common.pytest_jsonl", "--rootdir", str(tmp_path), "-c", os.devnull,
                    str(tmp_path / "test_sample.py")], env=env,
                   cwd=tmp_path, capture_output=True, text=True)
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert {k: (r["outcome"], r["when"]) for k, r in rows.items()} == {
        "test_ok": ("passed", "call"), "test_bad": ("failed", "call"), "test_skipped": ("skipped", "setup"),
        "test_setup_fails": ("failed", "setup")}
    assert "assert 1 == 2" in rows["test_bad"]["error"] and "no device" in rows["test_setup_fails"]["error"]
    assert "needs a CUDA device" in rows["test_skipped"]["reason"]


def test_the_stack_check_names_what_is_missing_and_fails(monkeypatch, capsys):
    """The correctness stage's first step (benchmarks/gpu/stack.py): this stack passes; a needed package that does
    not import, or a torch API the GPU paths call that is absent, fails it with the name in the message."""
    from benchmarks.gpu import stack as gpu_stack

    assert gpu_stack.main([]) == 0
    assert f"torch {torch.__version__}" in capsys.readouterr().out
    monkeypatch.setitem(gpu_stack.NEEDED, "moeflow_no_such_package", "the test")
    monkeypatch.setattr(gpu_stack, "TORCH_APIS", (*gpu_stack.TORCH_APIS, "cuda.no_such_api"))
    assert gpu_stack.main(["--pytest"]) == 1
    err = capsys.readouterr().err
    assert "moeflow_no_such_package: MISSING" in err and "torch.cuda.no_such_api: missing" in err


def test_gpu_decode_profile_tiny(tmp_path):
    """The decode stage's profile at the CPU sizes: every row decodes the resident tokens; lru's graph row captures
    once, at the warmed-up shape (the timed generate replays), and is not refused."""
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.decode_profile", "--tiny", "--graphs",
                           "--slots", "8", "--new-tokens", "4", "--profile-steps", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # lru three times: early_hits at its default (on CUDA: on; here off, nothing to overlap), the same with the
    # captured prelude off, and early hits forced off
    assert [(r["policy"], r["mode"]) for r in rows] == [
        (p, m) for p in ("resident", "lru", "lru", "lru") for m in ("eager", "cuda_graphs")]
    assert [r["early_hits"] for r in rows] == [None, None] + [False] * 6
    assert [r["captured_preludes"] for r in rows] == [None, None, True, True, False, False, True, True]
    # (the CPU sizes run the torch kernels, whose routing stays eager: the GPU's Triton path captures it)
    assert [r["layers_with_prelude"] for r in rows if r["mode"] == "cuda_graphs"] == [0, 0, 0, 0]
    assert all("error" not in r and r["tokens_equal_resident"] for r in rows), rows
    # (resident's torch reference kernels read values on the host: the CPU stand-in refuses them, the GPU does not)
    assert all(r["captures"] == 1 and r["refused"] is None for r in rows
               if r["mode"] == "cuda_graphs" and r["policy"] == "lru"), rows
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_run_gpu_deltanet_tiny_lines_agree_and_survive_a_failing_point(tmp_path, monkeypatch):
    """The DeltaNet stage at the CPU sizes (Triton interpreted): one JSON line per (point, implementation) as it is
    taken, the Triton outputs and states equal to the torch reference's (fp32), a failing point recorded."""
    from benchmarks.gpu import deltanet as run_gpu_deltanet

    real = run_gpu_deltanet.triton_core

    def failing_at_3_rows(layer, x):
        if x["qkv"].shape[0] == 3:
            raise RuntimeError("out of memory (planted)")
        return real(layer, x)

    monkeypatch.setattr(run_gpu_deltanet, "triton_core", failing_at_3_rows)
    out = tmp_path / "deltanet.jsonl"
    lines = run_gpu_deltanet.main(["--tiny", "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
    env, rows = lines[0], lines[1:]
    assert env["kind"] == "env" and env["sizes"]["linear_num_value_heads"] == 4
    assert [(r["mode"], r["rows"], r["tokens"], r["impl"]) for r in rows] == [
        (m, n, t, impl) for m, n, t in (("decode", 1, 1), ("decode", 3, 1), ("prefill", 1, 8), ("prefill", 1, 70))
        for impl in ("torch", "triton")]
    failed = rows[3]
    assert "planted" in failed["error"] and "us" not in failed
    for r in rows[:3] + rows[4:]:
        assert "error" not in r, r
        assert r["us"] > 0 and r["timed_as"] == "wall_clock" and r["bytes"] > r["state_bytes"] > 0
    for r in (rows[1], rows[5], rows[7]):  # decode, a short prompt, a prompt past one 64-token chunk
        assert r["all_finite"] and r["ref_max_abs"] > 1e-3
        assert r["max_abs_diff"] < 1e-5 and r["max_abs_diff_state"] < 1e-5, r
