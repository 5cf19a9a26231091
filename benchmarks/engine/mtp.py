"""MTP speculation against plain greedy decoding on a small DeepSeek-V3-shaped model whose MTP layer is trained
(distilled on the CPU from the model's own greedy continuations): draft acceptance, expert bytes moved per
generated token (offloaded, lru at 25 % and 50 % of the main model's experts, the MTP layer's experts sharing the
slots) and CPU decode tok/s, with the tokens checked equal to plain greedy's.

The main model is random (transformers' DeepseekV3ForCausalLM, weights scaled as the tests' tiny models so routing
is far from ties); only its MTP layer is trained: its block (transformers' decoder layer N of an N + 1 layer model,
MLA + MoE) and ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``, to predict token i + 2 from the final-normed
hidden state at i and token i + 1 on greedy continuations of random prompts (the main model's embedding and head
frozen, shared). So acceptance is real for this model, but it is not the issue's corpus-trained model (that one:
benchmarks/engine/mtp_trained.py on scripts/train_mtp_model.py's checkpoint).
``--forced``: rows where each draft token is replaced by the plain greedy one with a given probability after the
real MTP passes ran (their expert traffic counted): bytes per generated token against acceptance on this model.

    python -m benchmarks.engine.mtp [--steps 300] [--new-tokens 48] [--out benchmarks/results/mtp/<name>.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import moeflow.engine.mtp as mtp_engine
from moeflow import MoEModel, OffloadConfig

N_LAYERS, EXPERTS, TOP_K, VOCAB = 5, 16, 2, 97  # decoder layers (the first dense), routed experts
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              max_position_embeddings=256, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=4,
              topk_group=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, norm_topk_prob=True, routed_scaling_factor=2.5,
              tie_word_embeddings=False)
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def random_model(seed: int, std: float):
    """transformers' DeepSeek-V3 of N + 1 layers (layer N: the MTP block), weights as the tests' tiny models
    (normal, ``std``; routers 0.5, norms uniform 0.8-1.2). A smaller ``std`` makes a smoother, more predictable
    model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **CONFIG, num_hidden_layers=N_LAYERS + 1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mtp_logits(model, own: dict, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer (DeepSeek-V3 §2.2) over hidden [B, T, H] (final-normed) and next_ids [B, T] -> logits."""
    inner, t = model.model, next_ids.shape[1]
    emb = inner.embed_tokens(next_ids).clone()
    emb[:, 0] = 0.0  # position 0
    x = torch.cat((rms(emb, own["enorm.weight"]), rms(hidden, own["hnorm.weight"])), -1) @ own["eh_proj.weight"].T
    pos = torch.arange(t)[None].expand(x.shape[0], t)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    y = inner.layers[N_LAYERS](x, attention_mask=causal, position_ids=pos, position_embeddings=inner.rotary_emb(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    return model.lm_head(rms(y, own["shared_head.norm.weight"]))


@torch.no_grad()
def main_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    inner, t = model.model, ids.shape[1]
    x = inner.embed_tokens(ids)
    pos = torch.arange(t)[None].expand(ids.shape[0], t)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    cos_sin = inner.rotary_emb(x, pos)
    for layer in inner.layers[:N_LAYERS]:
        x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
        x = x[0] if isinstance(x, tuple) else x
    return inner.norm(x)


def write_checkpoint(model, own: dict, directory: Path) -> None:
    model.save_pretrained(directory)
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors.update({f"model.layers.{N_LAYERS}.{k}": v.detach().clone() for k, v in own.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(num_hidden_layers=N_LAYERS, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(cfg))


def train(model, own: dict, seqs: torch.Tensor, steps: int, seed: int) -> list[float]:
    """Distil the MTP layer: predict seqs[:, i + 2] from the hidden state at i and seqs[:, i + 1]."""
    hidden = main_hidden(model, seqs)
    params = list(model.model.layers[N_LAYERS].parameters()) + list(own.values())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        batch = torch.randint(0, seqs.shape[0], (32,))
        logits = mtp_logits(model, own, hidden[batch, :-2], seqs[batch, 1:-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seqs[batch, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(round(float(loss.detach()), 4))
    for p in params:
        p.requires_grad_(False)
    return losses


def forced_drafts(correct: float, truths: list, seed: int):
    """A stand-in for :func:`moeflow.engine.mtp.propose` that runs the real MTP passes (their expert traffic
    included) and then makes each draft token the plain greedy one with probability ``correct``: bytes per generated
    token as a function of acceptance, on this model. ``truths[0]``: the current prompt's plain greedy output."""
    real = mtp_engine.propose
    rng = random.Random(seed)

    def propose(drafter, mtp_in, k, n, pad, history, device, choose):
        draft, qs = real(drafter, mtp_in, k, n, pad, history, device, choose)
        truth = truths[0]
        return [int(truth[n + j]) if rng.random() < correct else tok for j, tok in enumerate(draft)], qs

    return propose


def measure(path: Path, prompts: torch.Tensor, new: int, setting: dict, k: int | None,
            correct: float | None = None, truths: list | None = None) -> dict:
    model = MoEModel.from_pretrained(path, mtp=k is not None, offload=OffloadConfig(**setting))
    totals = dict(drafted=0, accepted=0, bytes=0, decoded=0, seconds=0.0, passes=0)
    outs = []
    holder: list = [None]
    real = mtp_engine.propose
    if correct is not None:
        mtp_engine.propose = forced_drafts(correct, holder, 0)
    try:
        for i, ids in enumerate(prompts):
            if truths is not None:
                holder[0] = truths[i][0]
            model.stats.reset()
            start = time.perf_counter()
            out = model.generate(ids[None], max_new_tokens=new, do_sample=False, eos_token_id=[],
                                 num_speculative_tokens=k)
            totals["seconds"] += time.perf_counter() - start
            outs.append(out)
            s = model.stats
            totals["drafted"] += s.draft_tokens
            totals["accepted"] += s.accepted_tokens
            totals["bytes"] += s.decode.bytes_h2d
            totals["passes"] += s.decode.steps
            totals["decoded"] += new - 1  # tokens after the first (the decode phase)
    finally:
        mtp_engine.propose = real
        model.experts.close()
    return dict(totals, outs=outs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forced", type=float, nargs="*", default=[0.6, 0.8, 1.0],
                    help="also measure bytes with drafts made right with these probabilities (acceptance sweep)")
    ap.add_argument("--std", type=float, default=0.1, help="the main model's weight scale (0.1: the tests')")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = random_model(args.seed, args.std)
    g = torch.Generator().manual_seed(args.seed + 1)
    own = {"enorm.weight": torch.ones(64), "hnorm.weight": torch.ones(64),
           "eh_proj.weight": 0.1 * torch.randn(64, 128, generator=g), "shared_head.norm.weight": torch.ones(64)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write_checkpoint(model, own, path)  # (untrained MTP: the main model's greedy continuations come from it)
        plain_model = MoEModel.from_pretrained(path)
        train_prompts = torch.randint(0, VOCAB, (args.sequences, 8), generator=g)
        start = time.perf_counter()
        seqs = plain_model.generate(train_prompts, max_new_tokens=56, do_sample=False, eos_token_id=[])
        losses = train(model, own, seqs, args.steps, args.seed)
        train_s = time.perf_counter() - start
        write_checkpoint(model, own, path)
        prompts = torch.randint(0, VOCAB, (args.prompts, 8), generator=torch.Generator().manual_seed(args.seed + 2))
        main_experts = (N_LAYERS - 1) * EXPERTS
        settings = {"resident": dict(policy="resident")}
        for frac in (0.25, 0.5):
            settings[f"lru-{int(frac * 100)}%"] = dict(policy="lru", gpu_expert_slots=round(frac * main_experts))
        rows = []
        for name, setting in settings.items():
            plain = measure(path, prompts, args.new_tokens, setting, None)
            for k in (1, 2, 3):
                spec = measure(path, prompts, args.new_tokens, setting, k)
                same = all(torch.equal(a, b) for a, b in zip(plain["outs"], spec["outs"], strict=True))
                row = dict(setting=name, k=k, tokens_equal=same, acceptance=spec["accepted"] / max(spec["drafted"], 1),
                           tokens_per_verify_pass=spec["decoded"] / spec["passes"],
                           plain_tok_s=plain["decoded"] / plain["seconds"],
                           spec_tok_s=spec["decoded"] / spec["seconds"])
                if setting["policy"] != "resident":
                    row.update(plain_bytes_per_token=plain["bytes"] / plain["decoded"],
                               spec_bytes_per_token=spec["bytes"] / spec["decoded"])
                    row["bytes_ratio"] = row["spec_bytes_per_token"] / row["plain_bytes_per_token"]
                row["speed_ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}))
            if setting["policy"] == "resident":
                continue
            for correct in args.forced:  # drafts made right with this probability (the MTP passes still run)
                for k in (1, 2):
                    spec = measure(path, prompts, args.new_tokens, setting, k, correct, plain["outs"])
                    same = all(torch.equal(a, b) for a, b in zip(plain["outs"], spec["outs"], strict=True))
                    row = dict(setting=name, k=k, forced_correct=correct, tokens_equal=same,
                               acceptance=spec["accepted"] / max(spec["drafted"], 1),
                               tokens_per_verify_pass=spec["decoded"] / spec["passes"],
                               bytes_ratio=spec["bytes"] / plain["bytes"])
                    rows.append(row)
                    print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}))
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    cpu += " (" + " ".join(f for f in flags if f.startswith("avx512")) + ")"
    report = dict(model=dict(CONFIG, num_hidden_layers=N_LAYERS, num_nextn_predict_layers=1), init_std=args.std,
                  train_steps=args.steps,
                  train_sequences=args.sequences, train_losses=losses, train_and_generate_s=round(train_s, 1),
                  prompts=args.prompts, new_tokens=args.new_tokens, cpu=cpu, threads=1,
                  uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), rows=rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
