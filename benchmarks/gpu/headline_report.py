"""The GPU loan's short table (benchmarks/gpu_loan.sh): the ratios moeflow / llama.cpp per share, for every moeflow
row (on the AWQ checkpoint, and on the very GGUF file llama.cpp ran: ``moeflow GGUF-Q4_0 ...``; written back into
each ``headline_<family>.json``) and Markdown from the JSON a loan leaves in its results folder
``benchmarks/results/<gpu>-<date>/`` (``headline_<family>.json`` of gpu/headline.py, ``kernels.json`` of
gpu/kernels.py, ``pytest-cuda.jsonl`` of the correctness set, ``stack.txt``), written to ``headline.md``.

    python -m benchmarks.gpu.headline_report benchmarks/results/h200-2026-12-01
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

GiB = 2**30


def results_dir(gpu_name: str, date: str, root: Path = Path("benchmarks/results")) -> Path:
    """``<root>/<gpu>-<date>``: the GPU's short name ("NVIDIA H200" -> "h200") and the loan's date (YYYY-MM-DD)."""
    words = [w for w in re.split(r"[^a-z0-9]+", gpu_name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return root / f"{'-'.join(words[:2]) or 'gpu'}-{date}"


def ratios(data: dict) -> list[dict]:
    """moeflow / llama.cpp decode tok/s (and TTFT llama.cpp / moeflow) per share of the experts on the GPU."""
    llama = {r["n_cpu_moe"]: r for r in data.get("llama", []) if r.get("decode_tok_s")}
    out = []
    for m in data.get("moeflow", []):
        peer = llama.get(m["n_cpu_moe"])
        if not m.get("decode_tok_s") or peer is None:
            continue
        out.append({"share": m["share"], "gpu_experts": m["gpu_experts"], "moeflow": m["engine"],
                    "decode_ratio": m["decode_tok_s"] / peer["decode_tok_s"],
                    "ttft_ratio": peer["ttft_s"] / m["ttft_s"] if m.get("ttft_s") else None})
    return out


def _f(v, fmt: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def family_table(data: dict) -> list[str]:
    cfg = data["config"]
    L = cfg["num_hidden_layers"]
    E = cfg.get("num_local_experts") or cfg.get("num_experts")
    experts = data.get("experts", "Q4_0")
    lines = [f"## {data['family']}{'' if experts == 'Q4_0' else ' ' + experts} ({L} layers x {E} experts, top "
             f"{cfg['num_experts_per_tok']}; "
             f"{data.get('device_name', '?')}, {data.get('date', '?')})", "",
             f"CPU: {data.get('cpu', '?')}, {data.get('cpu_count', '?')} cores ({data.get('uptime', '')}).", "",
             f"{data['new_tokens']} decoded tokens after a {data['prompt_len']}-token prompt. "
             f"{data.get('routing_note', '')}.", ""]
    ck = data.get("checkpoints")
    if ck and "awq_bytes" not in ck:  # a K-quant file alone (gguf_checkpoint's random-block Q4_K_M experts)
        lines += [f"Checkpoint: GGUF with {ck.get('experts')} experts (random blocks), {ck['gguf_bytes'] / GiB:.1f} "
                  f"GiB written in {ck['gguf_write_s']} s; llama.cpp and moeflow read this one file.", ""]
    elif ck:
        lines += [f"Checkpoints: AWQ {ck['awq_bytes'] / GiB:.1f} GiB written in {ck['awq_write_s']} s, "
                  f"GGUF Q4_0 {ck['gguf_bytes'] / GiB:.1f} GiB in {ck['gguf_write_s']} s (same 4-bit weights).", ""]
    for suffix, what in (("", "the AWQ checkpoint"), ("_gguf", f"the {experts} GGUF llama.cpp ran")):
        if data.get("moeflow_load_s" + suffix) is not None:
            lines += [f"moeflow load of {what}: {data['moeflow_load_s' + suffix]} s "
                      f"({data.get('moeflow_kernels' + suffix)} kernels; {data.get('moeflow_format' + suffix)})", ""]
    for key in ("llama_error", "moeflow_error", "moeflow_error_gguf"):
        if data.get(key):
            lines += [f"{key}: {data[key]}", ""]
    lines += ["| engine | experts on GPU | share | decode tok/s | TTFT s | decode hit | GiB moved | peak GiB | "
              "tokens = resident | note |", "|" + "---|" * 10]
    rows = sorted(data.get("llama", []) + data.get("moeflow", []), key=lambda r: (-r["share"], r["engine"]))
    for r in rows:
        head = f"| {r['engine']} | {r['gpu_experts']} | {r['share']:.0%} |"
        if "error" in r:
            lines.append(head + f" error | | | | | | {r['error'][:100]!r} |")
            continue
        moved = r.get("bytes_h2d")
        if r["engine"].startswith("llama"):
            note = f"n_cpu_moe {r['n_cpu_moe']}, {r.get('backends')}, {r.get('gpu') or 'no GPU'}"
        else:
            note = f"CPU experts {r.get('cpu_experts', 0)}"
            if "tokens_equal_awq_resident" in r:  # the GGUF rows: the same tokens as the AWQ checkpoint's?
                note += f", tokens = AWQ resident: {_f(r['tokens_equal_awq_resident'], '')}"
        lines.append(head + f" {_f(r.get('decode_tok_s'))} | {_f(r.get('ttft_s'), '.3f')} | "
                     f"{_f(r.get('decode_hit_rate'), '.0%')} | {_f(None if moved is None else moved / GiB)} | "
                     f"{_f(None if r.get('peak_gpu_bytes') is None else r['peak_gpu_bytes'] / GiB)} | "
                     f"{_f(r.get('tokens_equal_resident'), '')} | {note} |")
    rat = data.get("ratios") or ratios(data)
    if rat:
        lines += ["", "| share on GPU | moeflow | decode moeflow / llama.cpp | TTFT llama.cpp / moeflow |",
                  "|---|---|---|---|"]
        lines += [f"| {q['share']:.0%} | {q['moeflow']} | {q['decode_ratio']:.2f}x | {_f(q['ttft_ratio'])}x |"
                  for q in rat]
    return lines + [""]


def kernels_table(report: dict) -> list[str]:
    bw = report.get("copy_bandwidth")
    lines = ["## Kernels (W4A16 MoE, CUDA-graph replay)", "",
             f"device-copy bandwidth {bw / 1e9:.0f} GB/s" if isinstance(bw, (int, float)) else "", "",
             "| shape | T | us | % copy BW | panel / row-major |", "|---|---|---|---|---|"]
    for r in report.get("results", []):
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | error: {r['error'][:60]} | | |")
        else:
            lines.append(f"| {r['shape']} | {r['T']} | {r['ours_s'] * 1e6:.1f} | {100 * r['frac_of_copy_bw']:.0f} | "
                         f"{_f(r.get('panel_speedup'))} |")
    return lines + [""]


def pytest_summary(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    failed = [r["test"] for r in rows if r["outcome"] == "failed"]
    return ["## Correctness set", "", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no tests ran",
            *[f"* FAILED {t}" for t in failed], ""]


def write_markdown(out: Path) -> Path:
    """``out/headline.md`` from what the loan left in ``out``; returns its path."""
    lines = ["# GPU loan: moeflow vs llama.cpp --n-cpu-moe", ""]
    stack = out / "stack.txt"
    if stack.is_file():
        lines += ["```", *stack.read_text().strip().splitlines()[:12], "```", ""]
    if (out / "pytest-cuda.jsonl").is_file():
        lines += pytest_summary(out / "pytest-cuda.jsonl")
    if (out / "kernels.json").is_file():
        lines += kernels_table(json.loads((out / "kernels.json").read_text()))
    for path in sorted(out.glob("headline_*.json")):
        data = json.loads(path.read_text())
        data["ratios"] = ratios(data)
        path.write_text(json.dumps(data, indent=1, default=str))
        lines += family_table(data)
    md = out / "headline.md"
    md.write_text("\n".join(lines) + "\n")
    return md


if __name__ == "__main__":
    print(write_markdown(Path(sys.argv[1])).read_text())
