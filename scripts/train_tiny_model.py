#!/usr/bin/env python
"""Train the small Mixtral that moeflow embeds as its default model (issue 2, item 6).

The model is a transformers ``MixtralForCausalLM`` with a byte-level vocabulary (256 ids, id == byte value),
hidden 128, intermediate 256, 4 layers, 4 attention heads / 2 KV heads, 8 experts, top-2. It is trained on text
that ships with Python itself, so the run needs no download:

* every topic of ``pydoc_data.topics`` (sorted by topic name), then
* the module docstring of every pure-Python stdlib module, read with ``ast`` from the source file (nothing is
  imported, so no module can have side effects or fail to import; test packages, ``lib2to3`` and
  site-packages are skipped), sorted by dotted module name, then
* the ``__doc__`` of the interpreter's built-in modules (``sys.builtin_module_names``, sorted; they are
  compiled into the interpreter, so importing them runs no Python code).

Held-out split: the corpus is cut into 4096-byte blocks and every 20th block (index 19, 39, ...) is held out,
5 % of the bytes spread evenly over topics and docstrings. The corpus differs between Python versions: the
report records the Python version, its size and its SHA-256.

Routing: a load-balancing loss is computed *per layer* from the router logits (``output_router_logits=True``)
and averaged over layers. transformers' own ``load_balancing_loss_func`` pools all layers before multiplying
the usage and probability vectors, so a single layer can still collapse while the pooled usage looks
balanced. The per-layer loss has the same scale as transformers' (top_k at perfect balance), and its
coefficient is stored as ``router_aux_loss_coef`` in config.json.

Deterministic: seeded initialisation and batch sampling, a fixed number of threads. ``--steps N`` fixes the
run completely. ``--minutes M`` times the first warm-up steps (whose learning rate does not depend on the
total), fixes N from that, and then runs exactly N steps, so ``--steps N`` with the N printed in the report
reproduces the same weights.

Output (written to a temporary directory, then renamed to --out): config.json, model.safetensors and
generation_config.json from ``save_pretrained``, tokenizer.json (byte-level, id == byte), training_report.json.

    python -m scripts.train_tiny_model --minutes 9 --out build/tiny-mixtral-fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

# With 2 threads on a busy 2-core machine, OpenMP's default spin-waiting made steps ~3x slower (561 vs 1802 tok/s
# measured); waiting passively costs nothing when the machine is idle. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from scripts.tiny_corpus import build_byte_tokenizer, collect_corpus, split_corpus  # re-exported

SAMPLE_PROMPT = "The import statement"

# ----------------------------------------------------------------------------------------------------------------
# Model, loss, evaluation


def make_config(args):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        router_aux_loss_coef=args.aux_coef,
        router_jitter_noise=0.0,
        output_router_logits=False,  # the training loop asks for them per call
    )


def per_layer_balance_loss(router_logits, top_k: int):
    """Switch-style load-balancing loss computed for each layer separately, averaged over layers.

    Per layer: E * sum_e f_e * P_e, with f_e the share of the top-k slots given to expert e (summing to top_k,
    as transformers counts) and P_e the mean router probability; top_k at perfect balance.
    """
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_experts = probs.shape[-1]
        with torch.no_grad():
            sel = torch.topk(probs, top_k, dim=-1).indices
            counts = torch.zeros(n_experts, dtype=probs.dtype).scatter_add_(
                0, sel.reshape(-1), torch.ones(sel.numel(), dtype=probs.dtype)
            )
            f = counts / probs.shape[0]
        losses.append(n_experts * torch.sum(f * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def evaluate(model, heldout, seq_len: int, batch_size: int, max_windows: int | None = None) -> dict:
    """Held-out bits/byte over non-overlapping windows, and per-layer routing statistics."""
    import torch

    n_layers = model.config.num_hidden_layers
    n_experts = model.config.num_local_experts
    top_k = model.config.num_experts_per_tok
    n_windows = (heldout.numel() - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    windows = [heldout[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)]
    nll_sum, n_tokens = 0.0, 0
    counts = torch.zeros(n_layers, n_experts, dtype=torch.float64)
    router_entropy = torch.zeros(n_layers, dtype=torch.float64)
    reuse = torch.zeros(n_layers, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, n_windows, batch_size):
            batch = torch.stack(windows[start : start + batch_size])
            x, y = batch[:, :-1], batch[:, 1:]
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            nll = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(),
                                                    y.reshape(-1), reduction="sum")
            nll_sum += nll.item()
            n_tokens += y.numel()
            for layer, logits in enumerate(out.router_logits):
                probs = torch.softmax(logits.double(), dim=-1)
                sel = torch.topk(probs, top_k, dim=-1).indices
                counts[layer] += torch.bincount(sel.reshape(-1), minlength=n_experts).double()
                router_entropy[layer] += -(probs * probs.clamp_min(1e-30).log()).sum()
                # share of a token's experts that the previous token (same sequence) also used
                onehot = torch.zeros_like(probs).scatter_(1, sel, 1.0).reshape(x.shape[0], x.shape[1], n_experts)
                reuse[layer] += (onehot[:, 1:] * onehot[:, :-1]).sum()
    model.train(was_training)
    n_pairs = n_windows * (seq_len - 1) * top_k
    token_entropy = router_entropy / n_tokens / math.log(n_experts)
    usage = counts / counts.sum(dim=1, keepdim=True)
    usage_entropy = -(usage * usage.clamp_min(1e-30).log()).sum(dim=1) / math.log(n_experts)
    return {
        "bits_per_byte": nll_sum / n_tokens / math.log(2),
        "tokens": n_tokens,
        "usage_entropy_fraction": [round(v, 4) for v in usage_entropy.tolist()],
        "expert_usage": [[round(v, 4) for v in row] for row in usage.tolist()],
        "min_expert_share": [round(v, 4) for v in usage.min(dim=1).values.tolist()],
        # mean entropy of each token's router distribution / log E: low means confident, token-dependent routing
        "token_router_entropy_fraction": [round(v, 4) for v in token_entropy.tolist()],
        # fraction of top-k experts shared with the previous token (random routing: top_k / E = 0.25)
        "consecutive_reuse": [round(v, 4) for v in (reuse / n_pairs).tolist()],
    }


def lr_at(step: int, total: int | None, args) -> float:
    """Linear warm-up over args.warmup steps (independent of total), then cosine down to 10 %."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    if total is None:
        raise RuntimeError("total steps must be known after warm-up")
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def random_batch(train, seq_len: int, batch_size: int, gen):
    """``batch_size`` windows of ``seq_len + 1`` bytes (inputs and their next bytes) at random offsets of
    ``train`` (uint8/int64 [n])."""
    import torch

    offs = torch.randint(0, train.numel() - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([train[o : o + seq_len + 1] for o in offs.tolist()])


class StepBudget:
    """The step count of a ``--minutes`` run (``args.steps`` None): steps ``calib_from`` .. ``args.warmup`` are
    timed and the time left since ``t_start``, times ``margin`` (evaluation and saving), divided by their mean."""

    def __init__(self, args, t_start: float, calib_from: int, margin: float) -> None:
        self.total, self.minutes, self.warmup = args.steps, args.minutes, args.warmup
        self.t_start, self.calib_from, self.margin = t_start, calib_from, margin
        self.t_calib: float | None = None

    def at(self, step: int) -> int | None:
        """Called at the start of every step: the total (None until the warm-up has been timed)."""
        if step == self.calib_from:
            self.t_calib = time.perf_counter()
        if self.total is None and step == self.warmup + 1:
            per_step = (time.perf_counter() - self.t_calib) / (self.warmup - self.calib_from)
            left = self.minutes * 60 - (time.perf_counter() - self.t_start)
            self.total = max(self.warmup + 1, int(left * self.margin / per_step))
            print(f"calibration: {per_step * 1e3:.0f} ms/step -> {self.total} steps", flush=True)
        return self.total


def generate_samples(model, tok, seed: int, max_new_tokens: int) -> dict:
    import torch

    ids = torch.tensor([tok.encode(SAMPLE_PROMPT).ids])
    model.eval()
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        torch.manual_seed(seed)
        sampled = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)

    def text(out):
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")

    return {"prompt": SAMPLE_PROMPT, "greedy": text(greedy), "sampled_t0.8_top40": text(sampled)}


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/tiny-mixtral-fp32"), help="output directory")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the run; overrides --minutes)")
    p.add_argument("--minutes", type=float, default=9.0, help="training time budget when --steps is not given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (results depend on it)")
    # Small batches: on a busy 2-core machine 9 minutes gave 421 steps of 8 x 256 bytes -> 2.44 bits/byte held out,
    # 911 steps of 4 x 256 -> 2.27 at the same tokens/s.
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="training context in bytes (<= 512)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--aux-coef", type=float, default=0.1, help="per-layer load-balancing loss coefficient")
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--eval-every", type=int, default=100, help="steps between quick held-out evaluations")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation_config default")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps <= args.warmup:
        p.error(f"--steps must exceed --warmup ({args.warmup})")
    if not 1 < args.seq_len <= 512:
        p.error("--seq-len must be in 2..512 (max_position_embeddings)")
    return args


def reproduce_command(args, steps: int) -> str:
    """The command line that repeats this run exactly: --steps, --seed, --threads, --out and changed options."""
    defaults = vars(parse_args([]))
    parts = ["python -m scripts.train_tiny_model", f"--steps {steps}"]
    parts += [f"--seed {args.seed}", f"--threads {args.threads}"]
    for key, value in vars(args).items():
        if key not in ("steps", "minutes", "seed", "threads", "out") and value != defaults[key]:
            parts.append(f"--{key.replace('_', '-')} {value}")
    parts.append(f"--out {args.out}")
    return " ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    import tokenizers
    import torch
    import transformers
    from transformers import GenerationConfig, MixtralForCausalLM

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    tok = build_byte_tokenizer()
    data, corpus_info = collect_corpus()
    train_bytes, heldout_bytes = split_corpus(data)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    heldout = torch.frombuffer(bytearray(heldout_bytes), dtype=torch.uint8).long()
    corpus_info.update(train_bytes=len(train_bytes), heldout_bytes=len(heldout_bytes))
    print(f"corpus: {corpus_info['bytes']:,} bytes ({corpus_info['pydoc_topics']} pydoc topics, "
          f"{corpus_info['stdlib_module_docstrings']} stdlib + {corpus_info['builtin_module_docstrings']} built-in "
          f"module docstrings), train {len(train_bytes):,}, held-out {len(heldout_bytes):,}, "
          f"sha256 {corpus_info['sha256'][:16]}", flush=True)

    config = make_config(args)
    model = MixtralForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, experts implementation "
          f"{getattr(config, '_experts_implementation', None)}, attention {config._attn_implementation}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    T, B = args.seq_len, args.batch_size
    total = args.steps
    budget_s = args.minutes * 60.0
    calib_from, calib_to = min(10, args.warmup // 2), args.warmup
    history = []
    t_train = time.perf_counter()
    t_calib = None
    eval_s = 0.0
    step = 0
    model.train()
    while total is None or step < total:
        step += 1
        if step == calib_from:
            t_calib = time.perf_counter()
        if total is None and step == calib_to + 1:
            per_step = (time.perf_counter() - t_calib - eval_s) / (calib_to - calib_from)
            total = max(args.warmup + 1, int((budget_s - eval_s) * 0.97 / per_step))
            print(f"calibration: {per_step * 1000:.0f} ms/step -> {total} steps for {args.minutes:g} min", flush=True)
        lr = lr_at(step, total, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_batch(train, T, B, gen)
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        aux = per_layer_balance_loss(out.router_logits, config.num_experts_per_tok)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == 1:
            elapsed = time.perf_counter() - t_train - eval_s
            print(f"step {step}/{total or '?'} lr {lr:.2e} ce {ce.item():.3f} ({ce.item() / math.log(2):.3f} bits) "
                  f"aux {aux.item():.3f} {step * B * T / elapsed:,.0f} tok/s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and (total is None or step < total):
            t0 = time.perf_counter()
            ev = evaluate(model, heldout, T, 16, max_windows=32)
            eval_s += time.perf_counter() - t0
            history.append({"step": step, "bits_per_byte": round(ev["bits_per_byte"], 4),
                            "usage_entropy_fraction": ev["usage_entropy_fraction"]})
            print(f"  eval@{step} (32 windows): {ev['bits_per_byte']:.3f} bits/byte, usage entropy "
                  f"{ev['usage_entropy_fraction']}", flush=True)
    train_s = time.perf_counter() - t_train - eval_s
    tokens = total * B * T
    print(f"trained {total} steps, {tokens:,} tokens in {train_s:.0f} s ({tokens / train_s:,.0f} tok/s)", flush=True)

    ev = evaluate(model, heldout, T, 16)
    print(f"held-out: {ev['bits_per_byte']:.4f} bits/byte over {ev['tokens']:,} bytes", flush=True)
    for layer in range(config.num_hidden_layers):
        print(f"  layer {layer}: usage entropy {ev['usage_entropy_fraction'][layer]:.3f} of max, "
              f"min expert share {ev['min_expert_share'][layer]:.3f}, "
              f"token router entropy {ev['token_router_entropy_fraction'][layer]:.3f}, "
              f"consecutive reuse {ev['consecutive_reuse'][layer]:.3f}", flush=True)

    model.generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=args.max_new_tokens, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    samples = generate_samples(model, tok, args.seed, args.max_new_tokens)
    print(f"greedy : {samples['greedy']!r}\nsampled: {samples['sampled_t0.8_top40']!r}", flush=True)

    out_dir = args.out
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save(str(tmp / "tokenizer.json"))
    report = {
        "seed": args.seed,
        "threads": args.threads,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": total,
        "tokens": tokens,
        "batch_size": B,
        "seq_len": T,
        "parameters": n_params,
        "train_wall_s": round(train_s, 1),
        "eval_wall_s": round(eval_s, 1),
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "tokens_per_s": round(tokens / train_s),
        "heldout": ev,
        "heldout_bits_per_byte": round(ev["bits_per_byte"], 4),
        "usage_entropy_fraction": ev["usage_entropy_fraction"],
        "eval_history": history,
        "samples": samples,
        "corpus": corpus_info,
        "config": config.to_dict(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "reproduce": reproduce_command(args, total),
    }
    (tmp / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    print(f"saved to {out_dir}; reproduce with: {report['reproduce']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
