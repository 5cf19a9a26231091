#!/usr/bin/env python
"""Train a small DeepSeek-V3-shaped model WITH one multi-token-prediction (MTP) layer on the CPU (issue 40), so
MTP speculation over offloaded experts is measured at a real acceptance rate.

Model: transformers' ``DeepseekV3ForCausalLM`` (MLA attention, sigmoid router with group-limited top-k and the
``e_score_correction_bias``, one shared expert), byte-level vocabulary (256 ids, id == byte), 4 decoder layers
(the first dense) and one MTP layer built as decoder layer 4 of a 5-layer model. Defaults: hidden 256, 32 routed
experts of width 128, top-4 in 4 groups (2 kept), 4 heads.

MTP (DeepSeek-V3 paper, §2.2, D = 1): the MTP layer predicts token t+2 from the main model's (final-normed) hidden
state at t and the embedding of token t+1: ``eh_proj([enorm(Emb(t+1)); hnorm(h_t)])``, its own decoder block,
``shared_head.norm``, then the main model's ``lm_head`` (embedding and head shared). Loss = main CE + lambda * MTP CE
(``--mtp-weight``, the paper's 0.3), gradients of the MTP loss flowing into the main model as in the paper. As the
engines that serve these checkpoints (and moeflow/families/mtp.py) do, the embedding at MTP position 0 is zeroed.

Balancing: DeepSeek-V3's auxiliary-loss-free bias (after each step, ``e_score_correction_bias += gamma * sign(mean
load - load)`` per MoE layer, ``--bias-rate``) and its complementary sequence-wise balance loss (``--seq-aux``,
alpha; scores normalised per token as the paper's P_i).

Corpus and split: scripts/tiny_corpus.py (the embedded model's: Python's own documentation text, every 20th 4 KiB
block held out). Deterministic for a given ``--steps`` and ``--threads``; ``--minutes`` fixes the step count from
the warm-up's speed and the report gives the ``--steps`` that reproduces it.

Output (--out): the checkpoint as DeepSeek-V3 publishes it (``num_hidden_layers`` = 4, ``num_nextn_predict_layers``
= 1, the MTP layer under ``model.layers.4.*`` with ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` and
the copies ``embed_tokens`` / ``shared_head.head``), tokenizer.json, training_report.json (loss curve, held-out
bits/byte, the MTP head's top-1 accuracy and its agreement with the main model's greedy next-next token).

    python -m scripts.train_mtp_model --minutes 35 --out build/mtp-deepseekv3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_tiny_model.py: busy 2-core machines

from scripts.tiny_corpus import build_byte_tokenizer, collect_corpus, split_corpus
from scripts.train_tiny_model import StepBudget, lr_at, random_batch

OWN = ("enorm", "hnorm", "eh_proj", "shared_head_norm")


def make_config(args, with_mtp_block: bool):
    """DeepseekV3Config of ``args.layers`` decoder layers (+ 1 for the MTP block when ``with_mtp_block``)."""
    from transformers import DeepseekV3Config

    h = args.hidden
    return DeepseekV3Config(
        vocab_size=256, hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers + int(with_mtp_block), num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=args.experts, num_experts_per_tok=args.top_k, n_group=args.groups,
        topk_group=args.topk_groups, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, q_lora_rank=h // 2, kv_lora_rank=h // 4, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        num_nextn_predict_layers=1,
    )


class MTPModule:
    """The MTP layer's own tensors (its block is the transformers model's last decoder layer)."""

    def __init__(self, hidden: int, eps: float):
        import torch
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps)
        torch.nn.init.normal_(self.eh_proj.weight, std=0.02)

    def modules(self):
        return [getattr(self, n) for n in OWN]


def run_layers(model, layers, x, positions):
    """x [B, T, H] through ``layers`` (transformers decoder layers) with a causal mask and RoPE at positions [B, T]."""
    import torch

    t = x.shape[1]
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    cos_sin = model.model.rotary_emb(x, positions)
    for layer in layers:
        x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
        x = x[0] if isinstance(x, tuple) else x
    return x


def forward(model, mtp: MTPModule, ids, n_layers: int):
    """ids [B, T + 1] -> (main logits [B, T, V] predicting ids[:, 1:], MTP logits [B, T - 1, V] predicting
    ids[:, 2:], main greedy [B, T])."""
    import torch

    inner = model.model
    x_ids = ids[:, :-1]
    b, t = x_ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    hidden = inner.norm(run_layers(model, inner.layers[:n_layers], inner.embed_tokens(x_ids), pos))
    logits = model.lm_head(hidden)
    emb = inner.embed_tokens(ids[:, 1:t])  # token t+1 for MTP positions 0..T-2
    emb = torch.cat((torch.zeros_like(emb[:, :1]), emb[:, 1:]), dim=1)  # MTP position 0: embedding zeroed
    fused = mtp.eh_proj(torch.cat((mtp.enorm(emb), mtp.hnorm(hidden[:, :-1])), dim=-1))
    y = run_layers(model, inner.layers[n_layers:], fused, pos[:, :-1])
    return logits, model.lm_head(mtp.shared_head_norm(y))


class RoutingRecorder:
    """Forward hooks on the MoE gates: each call's (scores [N, E], selected [N, k]) for the balancing."""

    def __init__(self, model):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.gates = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.calls: list = []
        for g in self.gates:
            g.register_forward_hook(self._hook)

    def _hook(self, gate, inputs, output):
        router_logits, _, topk_indices = output
        self.calls.append((gate, router_logits.sigmoid(), topk_indices))


def seq_balance_loss(calls, batch: int, top_k: int):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), averaged over MoE layers and sequences."""
    import torch

    losses = []
    for _, scores, sel in calls:
        e = scores.shape[-1]
        s = scores.reshape(batch, -1, e)
        p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
        with torch.no_grad():
            counts = torch.zeros(batch, e).scatter_add_(
                1, sel.reshape(batch, -1), torch.ones(batch, sel.reshape(batch, -1).shape[1]))
            f = counts * e / (top_k * s.shape[1])
        losses.append((f * p).sum(-1).mean())
    return torch.stack(losses).mean()


def update_bias(calls, rate: float) -> None:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded ones'."""
    import torch

    with torch.no_grad():
        for gate, _, sel in calls:
            load = torch.bincount(sel.reshape(-1), minlength=gate.e_score_correction_bias.numel()).float()
            gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def evaluate(model, mtp, heldout, n_layers: int, seq_len: int, windows: int, top_k: int) -> dict:
    """Held-out bits/byte (main, and the MTP head's t+2 CE), MTP top-1 accuracy against the text and agreement with
    the main model's greedy t+2 given its greedy t+1 where that equals the text's t+1, and each MoE layer's share of
    a token's experts also used by the previous token."""
    import torch

    n = min(windows, (heldout.numel() - 1) // seq_len)
    nll = mtp_nll = 0.0
    tokens = mtp_tokens = mtp_hit = agree = agree_n = main_hit = 0
    rec = RoutingRecorder(model)
    reuse: dict[int, list] = {}
    with torch.no_grad():
        for i in range(0, n, 8):
            batch = torch.stack([heldout[j * seq_len: j * seq_len + seq_len + 1] for j in range(i, min(n, i + 8))])
            rec.calls.clear()
            logits, mlog = forward(model, mtp, batch, n_layers)
            for li, (_, _, sel) in enumerate(rec.calls):
                oh = torch.zeros(sel.shape[0], model.config.n_routed_experts).scatter_(1, sel, 1.0)
                oh = oh.reshape(batch.shape[0], -1, oh.shape[-1])
                reuse.setdefault(li, []).append(((oh[:, 1:] * oh[:, :-1]).sum() / (oh[:, 1:].sum())).item())
            y = batch[:, 1:]
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum").item()
            tokens += y.numel()
            y2 = batch[:, 2:]
            mtp_nll += torch.nn.functional.cross_entropy(mlog.reshape(-1, 256), y2.reshape(-1), reduction="sum").item()
            mtp_tokens += y2.numel()
            greedy = logits.argmax(-1)  # [B, T]: main prediction of ids[:, 1:]
            draft = mlog.argmax(-1)  # [B, T-1]: MTP prediction of ids[:, 2:]
            mtp_hit += (draft == y2).sum().item()
            main_hit += (greedy == y).sum().item()
            # where the main model's greedy t+1 is the text's, its greedy t+2 is greedy[:, 1:]: acceptance proxy
            ok = greedy[:, :-1] == y[:, :-1]
            agree += ((draft == greedy[:, 1:]) & ok).sum().item()
            agree_n += ok.sum().item()
    for g in rec.gates:
        g._forward_hooks.clear()
    return {"bits_per_byte": nll / tokens / math.log(2),
            "mtp_bits_per_byte_t_plus_2": mtp_nll / mtp_tokens / math.log(2),
            "main_top1": main_hit / tokens, "mtp_top1_t_plus_2": mtp_hit / mtp_tokens,
            "mtp_agrees_with_main_greedy": agree / max(agree_n, 1), "tokens": tokens,
            "consecutive_expert_reuse": [round(sum(v) / len(v), 4) for v in reuse.values()],
            "chance_reuse": top_k / model.config.n_routed_experts}


def save(model, mtp: MTPModule, args, out_dir: Path, report: dict) -> None:
    """The checkpoint under DeepSeek-V3's published names (see the module docstring)."""
    import torch
    from safetensors.torch import save_file

    n = args.layers
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    prefix = f"model.layers.{n}."
    tensors.update({prefix + "enorm.weight": mtp.enorm.weight, prefix + "hnorm.weight": mtp.hnorm.weight,
                    prefix + "eh_proj.weight": mtp.eh_proj.weight,
                    prefix + "shared_head.norm.weight": mtp.shared_head_norm.weight,
                    prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
                    prefix + "shared_head.head.weight": tensors["lm_head.weight"]})
    dtype = getattr(torch, args.save_dtype)
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in tensors.items()}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = make_config(args, with_mtp_block=False)
    cfg.dtype = args.save_dtype
    cfg.save_pretrained(tmp)
    build_byte_tokenizer().save(str(tmp / "tokenizer.json"))
    (tmp / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/mtp-deepseekv3"))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the run; overrides --minutes)")
    p.add_argument("--minutes", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4, help="main decoder layers (the first dense)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--topk-groups", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss (DeepSeek-V3: 0.3, 0.1)")
    p.add_argument("--bias-rate", type=float, default=0.002, help="gamma of the aux-loss-free bias update")
    p.add_argument("--seq-aux", type=float, default=0.001, help="alpha of the sequence-wise balance loss")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq-len for the report")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps <= args.warmup:
        p.error(f"--steps must exceed --warmup ({args.warmup})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, info = collect_corpus()
    train_bytes, heldout_bytes = split_corpus(data)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    heldout = torch.frombuffer(bytearray(heldout_bytes), dtype=torch.uint8).long()
    config = make_config(args, with_mtp_block=True)
    config._experts_implementation = "grouped_mm"  # 2.5x eager's speed on the CPU, same sums (not saved)
    model = DeepseekV3ForCausalLM(config)
    mtp = MTPModule(args.hidden, model.config.rms_norm_eps)
    own = [p for m in mtp.modules() for p in m.parameters()]
    params = [p for _, p in model.named_parameters()] + own
    n_params = sum(p.numel() for p in params)
    print(f"corpus {info['bytes']:,} bytes; model {n_params:,} parameters (with the MTP layer)", flush=True)
    named = list(model.named_parameters()) + [(f"mtp.{i}", p) for i, p in enumerate(own)]
    decay = [p for n, p in named if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    rec = RoutingRecorder(model)
    gen = torch.Generator().manual_seed(args.seed)
    T, B, total = args.seq_len, args.batch_size, args.steps
    budget = StepBudget(args, t_start, calib_from=min(5, args.warmup // 2), margin=0.92)
    t_train, step, log = time.perf_counter(), 0, []
    model.train()
    while total is None or step < total:
        step += 1
        total = budget.at(step)
        lr = lr_at(step, total, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_batch(train, T, B, gen)
        rec.calls.clear()
        logits, mlog = forward(model, mtp, batch, args.layers)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        mtp_ce = torch.nn.functional.cross_entropy(mlog.reshape(-1, 256), batch[:, 2:].reshape(-1))
        aux = seq_balance_loss(rec.calls, B, args.top_k)
        loss = ce + args.mtp_weight * mtp_ce + args.seq_aux * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        update_bias(rec.calls, args.bias_rate)
        if step % 25 == 0 or step == 1:
            rate = step * B * T / (time.perf_counter() - t_train)
            log.append({"step": step, "ce_bits": round(ce.item() / math.log(2), 4),
                        "mtp_ce_bits": round(mtp_ce.item() / math.log(2), 4), "seq_aux": round(aux.item(), 4)})
            print(f"step {step}/{total or '?'} lr {lr:.2e} ce {log[-1]['ce_bits']:.3f} bits mtp "
                  f"{log[-1]['mtp_ce_bits']:.3f} bits aux {aux.item():.3f} {rate:,.0f} tok/s", flush=True)
    train_s = time.perf_counter() - t_train
    for g in rec.gates:
        g._forward_hooks.clear()
    model.eval()
    ev = evaluate(model, mtp, heldout, args.layers, T, args.eval_windows, args.top_k)
    print(json.dumps(ev), flush=True)
    defaults = vars(parse_args([]))
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k not in ("steps", "minutes", "out") and v != defaults[k]]
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    report = {"steps": total, "tokens": total * B * T, "train_s": round(train_s, 1), "parameters": n_params,
              "heldout": ev, "log": log, "corpus": info, "args": {k: str(v) for k, v in vars(args).items()},
              "cpu": cpu, "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "reproduce": " ".join(["python -m scripts.train_mtp_model", f"--steps {total}", *changed,
                                     f"--out {args.out}"])}
    save(model, mtp, args, args.out, report)
    print(f"saved to {args.out} in {time.perf_counter() - t_start:.0f} s; reproduce: {report['reproduce']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
