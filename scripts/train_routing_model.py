#!/usr/bin/env python
"""Train a small Qwen3-MoE-shaped model whose routing looks more like a real model's than the embedded one's
(issue 41): 8 layers, 64 experts, top-8, hidden 256, expert width 128, byte-level vocabulary, on the CPU.

The embedded model (scripts/train_tiny_model.py: 4 layers x 8 experts, top-2) routes a batch of 16 tokens to almost
every expert, so no policy table on it says how the papers' mechanisms compare on many-expert routing. This
script makes the checkpoint those tables need; scripts/paper_switches.py and the policy tables take it with
``--model``.

Corpus (no download): the Python documentation text of scripts/tiny_corpus.py, then the plain text of the
machine's man pages (section 1, ``man``'s roff stripped of its requests and font escapes, sorted by file name,
at most ``--man-mb`` MB) and the licence texts under /usr/share/common-licenses. The corpus differs between
machines: the report records its size and SHA-256. Held-out split as tiny_corpus's (every 20th 4 KiB block).

Training as scripts/train_tiny_model.py: AdamW, warm-up then cosine, the per-layer load-balancing loss, seeded;
``--minutes`` fixes the step count from the warm-up's speed and the report gives the ``--steps`` that reproduces
it. The report adds the routing statistics (moeflow.trace.stats: load skew, temporal locality, inter-layer
affinity) of the trained model on held-out text, recorded through moeflow itself.

    python -m scripts.train_routing_model --minutes 15 --out build/routing-qwen3moe
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_tiny_model.py: busy 2-core machines

from scripts.tiny_corpus import build_byte_tokenizer, collect_corpus, split_corpus
from scripts.train_tiny_model import StepBudget, lr_at, per_layer_balance_loss, random_batch

ROOT = Path(__file__).resolve().parents[1]

_ROFF_REQUEST = re.compile(rb"^\.[A-Za-z]{1,3}\b ?", re.M)
_ROFF_ESCAPE = re.compile(rb"\\f[BIRP]|\\f\(..|\\\(..|\\[&e-]|\\s[+-]?\d")


def man_text(limit_bytes: int) -> tuple[bytes, int]:
    """Section-1 man pages as plain-ish text (roff requests and font escapes removed), at most ``limit_bytes``."""
    out, n, total = [], 0, 0
    for path in sorted(Path("/usr/share/man/man1").glob("*.gz")):
        try:
            raw = gzip.decompress(path.read_bytes())
        except (OSError, EOFError):
            continue
        text = _ROFF_ESCAPE.sub(b"", _ROFF_REQUEST.sub(b"", raw))
        text = b"\n".join(ln for ln in text.splitlines() if not ln.startswith((b".\\\"", b"'\\\"")) and ln.strip())
        if total + len(text) > limit_bytes:
            break
        out.append(text)
        total += len(text) + 2
        n += 1
    return b"\n\n".join(out), n


def licence_text() -> tuple[bytes, int]:
    paths = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
    return b"\n\n".join(p.read_bytes() for p in paths), len(paths)


def corpus(man_mb: float) -> tuple[bytes, dict]:
    py, info = collect_corpus()
    man, n_man = man_text(int(man_mb * 2**20))
    lic, n_lic = licence_text()
    data = py + b"\n\n" + man + b"\n\n" + lic + b"\n"
    info.update(man_pages=n_man, man_bytes=len(man), licences=n_lic, licence_bytes=len(lic), bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest())
    return data, info


def make_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=args.aux_coef,
        output_router_logits=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/routing-qwen3moe"))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the run; overrides --minutes)")
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--aux-coef", type=float, default=0.01, help="per-layer load balancing (Qwen3-MoE: 0.001)")
    p.add_argument("--man-mb", type=float, default=24.0, help="man-page text taken, in MB")
    p.add_argument("--save-every", type=int, default=250,
                   help="steps between checkpoints saved to --out (an interrupted run leaves its latest one)")
    p.add_argument("--report-only", action="store_true",
                   help="no training: evaluate the checkpoint at --out again into its report")
    p.add_argument("--stats-prompts", type=int, default=24, help="held-out windows traced for the routing stats")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps <= args.warmup:
        p.error(f"--steps must exceed --warmup ({args.warmup})")
    return args


def held_out_bits(model, heldout, seq_len: int, max_windows: int = 64, batch_size: int = 8) -> dict:
    """Held-out bits/byte over ``max_windows`` windows of ``seq_len`` bytes spread evenly over the held-out text
    (Python docs, man pages and licences alike)."""
    import math

    import torch

    n = min(max_windows, (heldout.numel() - 1) // seq_len)
    stride = (heldout.numel() - seq_len - 1) // max(n, 1)
    windows = [heldout[i * stride: i * stride + seq_len + 1] for i in range(n)]
    nll, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, n, batch_size):
            batch = torch.stack(windows[start: start + batch_size])
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), batch[:, 1:].reshape(-1),
                                                     reduction="sum").item()
            count += batch[:, 1:].numel()
    model.train(was_training)
    return {"bits_per_byte": round(nll / count / math.log(2), 4), "bytes": count}


def save_checkpoint(model, out: Path, report: dict) -> None:
    """Write the checkpoint, tokenizer and ``report`` to ``out`` atomically (a ``.tmp`` sibling, then a rename)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    build_byte_tokenizer().save(str(tmp / "tokenizer.json"))
    (tmp / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def held_out_stats(out_dir: Path, heldout: bytes, n: int, seq_len: int = 96, new_tokens: int = 16) -> dict:
    """Routing statistics of the saved checkpoint on ``n`` held-out windows, recorded through moeflow."""
    import torch

    from moeflow import MoEModel
    from moeflow.tools.record import record_trace
    from moeflow.trace.stats import routing_stats

    model = MoEModel.from_pretrained(out_dir, device="cpu", dtype=torch.float32)
    step = max(1, (len(heldout) - seq_len) // max(n, 1))
    prompts = [list(heldout[i * step: i * step + seq_len]) for i in range(n)]
    trace = record_trace(model, prompts, new_tokens, progress=False)
    return routing_stats(trace)


def report_only(args, heldout, info: dict) -> int:
    """Evaluate the checkpoint at ``--out`` again (held-out bits/byte over the whole held-out text and over its
    Python-docs start, as the embedded model reports it) into its training_report.json, without training."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    path = args.out / "training_report.json"
    report = json.loads(path.read_text())
    py_bytes = split_corpus(collect_corpus()[0])[1]
    py = torch.frombuffer(bytearray(py_bytes), dtype=torch.uint8).long()
    report["heldout_all"] = held_out_bits(model, heldout, args.seq_len, max_windows=256)
    report["heldout_python_docs"] = held_out_bits(model, py, args.seq_len, max_windows=256)
    report["corpus_check"] = info["sha256"]
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("heldout_all", "heldout_python_docs")}), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import Qwen3MoeForCausalLM

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, info = corpus(args.man_mb)
    train_bytes, heldout_bytes = split_corpus(data)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    heldout = torch.frombuffer(bytearray(heldout_bytes), dtype=torch.uint8).long()
    if args.report_only:
        return report_only(args, heldout, info)
    print(f"corpus {info['bytes']:,} bytes ({info['man_pages']} man pages, {info['licences']} licences + Python "
          f"docs), sha256 {info['sha256'][:16]}", flush=True)
    config = make_config(args)
    model = Qwen3MoeForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    T, B, total = args.seq_len, args.batch_size, args.steps
    budget = StepBudget(args, t_start, calib_from=min(5, args.warmup // 2), margin=0.9)
    t_train, step, log = time.perf_counter(), 0, []
    model.train()
    while total is None or step < total:
        step += 1
        total = budget.at(step)
        lr = lr_at(step, total, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_batch(train, T, B, gen)
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        aux = per_layer_balance_loss(out.router_logits, args.top_k)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            rate = step * B * T / (time.perf_counter() - t_train)
            log.append({"step": step, "ce_bits": round(ce.item() / 0.6931, 4), "aux": round(aux.item(), 4)})
            print(f"step {step}/{total or '?'} lr {lr:.2e} ce {ce.item() / 0.6931:.3f} bits aux {aux.item():.3f} "
                  f"{rate:,.0f} tok/s", flush=True)
        if args.save_every and step % args.save_every == 0 and step != total:
            ev = held_out_bits(model, heldout, T, max_windows=16)
            log.append({"step": step, "heldout_bits_per_byte_16w": ev["bits_per_byte"]})
            save_checkpoint(model, args.out, {"partial": True, "step": step, "of_steps": total, "log": log,
                                              "train_s": round(time.perf_counter() - t_train, 1)})
            print(f"  checkpoint at step {step}: held-out {ev['bits_per_byte']:.3f} bits/byte (16 windows)",
                  flush=True)
    train_s = time.perf_counter() - t_train
    heldout_eval = held_out_bits(model, heldout, T)
    print(f"held-out: {heldout_eval['bits_per_byte']:.4f} bits/byte over {heldout_eval['bytes']:,} bytes", flush=True)
    save_checkpoint(model, args.out, {"partial": True, "step": total, "of_steps": total})
    stats = held_out_stats(args.out, heldout_bytes, args.stats_prompts)
    defaults = vars(parse_args([]))
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k not in ("steps", "minutes", "out", "save_every", "report_only") and v != defaults[k]]
    report = {"steps": total, "tokens": total * B * T, "train_s": round(train_s, 1), "parameters": n_params,
              "heldout": heldout_eval, "corpus": info, "log": log, "routing_stats_heldout": stats,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "reproduce": " ".join(["python -m scripts.train_routing_model", f"--steps {total}", *changed,
                                     f"--out {args.out}"])}
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(stats), flush=True)
    print(f"saved to {args.out} in {time.perf_counter() - t_start:.0f} s; reproduce: {report['reproduce']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
