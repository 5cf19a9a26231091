"""What ``device="cpu"`` does with 16-bit attention projections (issue 42, point 2), measured on the embedded
(trained) model: for ``attention_bits`` None (kept in fp32), 8 (the default, ``"auto"``) and 4, against the exact
fp32 reference (``kernels="torch"``, the same AWQ experts):

* held-out bits per byte (the embedded model's own held-out split, as scripts/build_embedded_model.py reports it);
* logit deviation on the reference's greedy paths (teacher-forced): relative norm and largest absolute deviation;
* greedy tokens: how many of ``--prompts`` held-out prompts give exactly the reference's ``--new`` tokens, and the
  share of positions equal.

    PYTHONPATH=. python -m benchmarks.cpu.attention_default --out benchmarks/results/cpu_attention_default
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.peers.peer_report import uptime, write_report
from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from scripts.build_embedded_model import heldout_stats
from scripts.train_tiny_model import collect_corpus, split_corpus

CHOICES = (None, 8, 4)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loads = [uptime()]
    path = embedded_model_path()
    _, heldout_bytes = split_corpus(collect_corpus()[0])
    heldout = torch.frombuffer(bytearray(heldout_bytes), dtype=torch.uint8).long()
    step = (heldout.numel() - args.prompt_len) // args.prompts
    prompts = torch.stack([heldout[i * step: i * step + args.prompt_len] for i in range(args.prompts)])
    ref = MoEOffloadedMixtral.from_pretrained(path, kernels="torch")
    kw = dict(do_sample=False, eos_token_id=[], max_new_tokens=args.new)
    want = ref.generate(prompts, **kw)
    ref_logits = ref(want).logits[:, args.prompt_len - 1:]
    rows = {"fp32 reference (kernels='torch')": {
        "bits_per_byte": heldout_stats(ref, heldout, args.seq_len, args.windows)["bits_per_byte"]}}
    for bits in CHOICES:
        t0 = time.perf_counter()
        m = MoEOffloadedMixtral.from_pretrained(path, attention_bits=bits)
        got = m.generate(prompts, **kw)
        logits = m(want).logits[:, args.prompt_len - 1:]
        dev = logits - ref_logits
        rows[f"cpu-int4, attention_bits={bits}"] = {
            "bits_per_byte": heldout_stats(m, heldout, args.seq_len, args.windows)["bits_per_byte"],
            "logit_rel_norm": float(dev.norm() / ref_logits.norm()),
            "logit_max_abs": float(dev.abs().max()),
            "argmax_agreement_teacher_forced": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "prompts_all_tokens_equal": int((got == want).all(1).sum()),
            "token_positions_equal": float((got[:, args.prompt_len:] == want[:, args.prompt_len:]).float().mean()),
            "seconds": time.perf_counter() - t0,
        }
        print(bits, json.dumps(rows[f"cpu-int4, attention_bits={bits}"]), flush=True)
    loads.append(uptime())
    res = {"model": str(path), "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new,
           "heldout_windows": args.windows, "seq_len": args.seq_len, "uptime": loads, "rows": rows}
    lines = [f"Embedded model ({path.name}), 16-bit attention on the CPU int4 path vs the fp32 reference: "
             f"held-out bits/byte ({args.windows} windows of {args.seq_len}), greedy tokens on {args.prompts} "
             f"held-out prompts of {args.prompt_len} bytes, {args.new} new tokens each.", "",
             *[f"uptime: `{u}`  " for u in loads], "",
             "| model | bits/byte | logit dev. (rel. norm) | largest logit dev. | prompts with all tokens equal "
             "| positions equal |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "logit_rel_norm" in r:
            lines.append(f"| {name} | {r['bits_per_byte']:.4f} | {r['logit_rel_norm']:.4f} | {r['logit_max_abs']:.3f} "
                         f"| {r['prompts_all_tokens_equal']}/{args.prompts} | {r['token_positions_equal']:.3f} |")
        else:
            lines.append(f"| {name} | {r['bits_per_byte']:.4f} | - | - | - | - |")
    print("\n".join(lines))
    if args.out:
        write_report(args.out, res, lines)


if __name__ == "__main__":
    main()
