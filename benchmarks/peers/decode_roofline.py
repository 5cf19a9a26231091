"""The memory roofline of a one-token CPU decode step (issue 42): the weight bytes one decoded token reads, per
engine, and the machine's plain read bandwidth (``read_probe.c``), so that a measured tok/s becomes GB/s and a
fraction of what the memory allows: tok/s x bytes per token / probe GB/s.

Bytes per token count the weights a decode step reads (attention projections, router, norms, top-k experts of
every layer, the lm_head, one embedding row), not the KV cache (~0.5 MB at the side-by-side's positions on the
peer model, < 0.5 %) nor activations. moeflow: from the loaded model's own matrices (:func:`moeflow_bytes`);
llama.cpp: from the GGUF file's tensors, the expert tensors at top_k / n_expert of their bytes
(:func:`gguf_bytes`).

    python -m benchmarks.peers.decode_roofline --threads 2 --model /tmp/peers/awq-qa --gguf /tmp/peers/x.gguf
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def probe_gbps(threads: int) -> dict[int, float]:
    """Read bandwidth GB/s at 1 .. ``threads`` threads (best of 7 passes over 512 MB each)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "read_probe"
        subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(HERE / "read_probe.c"), "-o", str(exe)],
                       check=True)
        out = subprocess.run([str(exe), str(threads)], capture_output=True, text=True, check=True).stdout
    return {int(k): v for k, v in json.loads(out).items()}


def _linear_bytes(m: Any) -> int:
    parts = getattr(m, "parts", None)  # SplitLinear
    return sum(p.nbytes for p in parts) if parts is not None else int(m.nbytes)


def _expert_bytes(form: Any) -> int:
    if isinstance(form, tuple):  # q4 (w13, w2)
        return form[0].nbytes + form[1].nbytes
    h, i = form.hidden_size, form.intermediate_size  # GGUFCpuExpert
    return 2 * i * form.gate_up_type.row_bytes(h) + h * form.down_type.row_bytes(i)


def moeflow_bytes(model: Any) -> dict[str, int]:
    """Weight bytes per decoded token of a ``device="cpu"`` model whose layers take the one native call: per part
    (attention, router and norms, experts, lm_head, embedding row) and ``total``."""
    from moeflow.engine.cpu_layers import _layer_experts

    dec = model.model
    step = dec.layers_step
    parts = {"attention": 0, "router_norms": 0, "experts": 0}
    for layer, block in zip(step.layers, step.blocks, strict=True):
        attn = layer.attention_step.attn
        parts["attention"] += _linear_bytes(attn.qkv_proj) + _linear_bytes(attn.o_proj)
        parts["router_norms"] += block.gate.weight.numel() * 4 + 2 * dec.norm.weight.numel() * 4
        forms = _layer_experts(model.experts, block.layer_idx)
        parts["experts"] += block.route.top_k * sum(map(_expert_bytes, forms)) // len(forms)
    parts["lm_head"] = int(dec.lm_head.nbytes) + dec.norm.weight.numel() * 4
    emb = getattr(dec.embed_tokens, "weight", None)  # (a file's stored embedding: ~a row of its blocks, uncounted)
    parts["embedding_row"] = 0 if emb is None else emb[0].numel() * emb.element_size()
    parts["total"] = sum(parts.values())
    return parts


def gguf_bytes(path: Path, top_k: int | None = None) -> dict[str, int]:
    """Weight bytes per decoded token llama.cpp reads from the GGUF file ``path`` (experts: top_k of them, default
    the file's ``<arch>.expert_used_count``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    if top_k is None:
        field = next(f for k, f in reader.fields.items() if k.endswith(".expert_used_count"))
        top_k = int(field.parts[field.data[0]][0])
    parts = {"experts": 0, "embedding_row": 0, "lm_head": 0, "other": 0}
    for t in reader.tensors:
        name, size = t.name, int(t.n_bytes)
        if "_exps." in name:
            parts["experts"] += size * top_k // int(t.shape[-1])
        elif name.startswith("token_embd"):
            parts["embedding_row"] += size // int(t.shape[-1])
        elif name.startswith("output."):
            parts["lm_head"] += size
        else:
            parts["other"] += size
    parts["total"] = sum(parts.values())
    return parts


def roofline_line(label: str, tok_s: float, bytes_per_token: int, probe: float) -> str:
    """``label: B MB/token x tok/s = GB/s = f of the probe's P GB/s (ceiling C tok/s)``."""
    gbps = tok_s * bytes_per_token / 1e9
    return (f"{label}: {bytes_per_token / 1e6:.1f} MB/token x {tok_s:.1f} tok/s = {gbps:.1f} GB/s = "
            f"{gbps / probe:.2f} of the probe's {probe:.1f} GB/s (ceiling {probe * 1e9 / bytes_per_token:.0f} tok/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a moeflow checkpoint loaded with device='cpu'")
    ap.add_argument("--attention-bits", default="auto")
    ap.add_argument("--gguf", type=Path, help="a GGUF file (llama.cpp's bytes)")
    ap.add_argument("--top-k", type=int, help="experts per token (default: the file's expert_used_count)")
    args = ap.parse_args()
    out: dict[str, Any] = {"probe_gbps": probe_gbps(args.threads)}
    if args.model:
        from moeflow import MoEOffloadedMixtral

        bits = None if args.attention_bits == "none" else args.attention_bits if args.attention_bits == "auto" \
            else int(args.attention_bits)
        m = MoEOffloadedMixtral.from_pretrained(args.model, device="cpu", attention_bits=bits, progress=False)
        out["moeflow_bytes"] = moeflow_bytes(m)
    if args.gguf:
        out["gguf_bytes"] = gguf_bytes(args.gguf, args.top_k)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
