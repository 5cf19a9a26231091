"""Which cheap proxy of a token's MoE-layer inputs predicts its experts best, on the trained MTP model (issue 40)?

Teacher-forced over held-out windows: for each position p >= 1 and main MoE layer l, the token's true top-k against
layer l's own router (``MoEBlock.route(gate(x))``) applied to a proxy computed before the position's own pass:
``prev_x`` (the previous position's real input to layer l: the locality a plain predictor reads), ``mtp_out`` (the
MTP block's output at position p - 1, which took token p as its input: what the drafting passes compute anyway),
``mtp_moe_in`` (the MTP block's own MoE input there), ``final_hidden_prev`` (the main model's final-normed hidden
state at p - 1), ``embed`` (token p's embedding); ``*_layernorm``: scaled by layer l's post-attention norm instead
of to unit RMS. Reported: the share of the true top-k the proxy's top-k names (chance k / E).

    python -m benchmarks.engine.mtp_proxies --out benchmarks/results/mtp/<name>.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.engine.mtp_trained import heldout_prompts
from moeflow import MoEModel
from moeflow.engine.mtp import MTPDrafter, eager_pass


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("build/mtp-deepseekv3"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = MoEModel.from_pretrained(args.model, mtp=True)
    runner = model._runner
    blocks = runner.decoder.moe_blocks
    norms = [layer.post_attention_layernorm for layer in runner.decoder.layers if layer.mlp in blocks]
    hits: dict[str, list[int]] = {}
    xs: dict[int, torch.Tensor] = {}  # this window's input of each main MoE layer [T, H]
    mtp: dict[str, torch.Tensor] = {}  # the MTP block's MoE input and output [T - 1, H]
    layer = model.mtp.layers[0]
    hooks = [b.register_forward_pre_hook(lambda m, a, i=b.layer_idx: xs.__setitem__(i, a[0].reshape(
        -1, a[0].shape[-1]))) for b in blocks]
    hooks.append(model.mtp.moe_blocks[0].register_forward_pre_hook(
        lambda m, a: mtp.__setitem__("moe_in", a[0].reshape(-1, a[0].shape[-1]))))
    hooks.append(layer.block.register_forward_hook(lambda m, a, out: mtp.__setitem__("out", out[0])))
    for ids in heldout_prompts(args.windows, args.length):
        ids, T = ids[None], ids.shape[0]
        pos, mask = torch.arange(T)[None], torch.ones_like(ids, dtype=torch.bool)
        _, hidden = eager_pass(runner, ids, pos, runner.new_cache(1, T, reuse=False), torch.arange(T), mask,
                               "prefill", (ids, mask), True)
        MTPDrafter(runner, model.mtp, T).run(0, hidden[:, :-1], ids[:, 1:], pos[:, :-1], torch.arange(T - 1),
                                             mask[:, :-1], (ids, mask))
        p = torch.arange(1, T)
        embeds = runner.decoder.embed_tokens(ids)[0, p]
        for i, block in enumerate(blocks):
            true = block.route(block.gate(xs[i]))[1][p].long()
            proxies = {"prev_x": xs[i][p - 1], "mtp_out": unit_rms(mtp["out"]),
                       "mtp_out_layernorm": norms[i](mtp["out"]), "mtp_moe_in": mtp["moe_in"],
                       "final_hidden_prev": unit_rms(hidden[0, p - 1]),
                       "embed": unit_rms(embeds), "embed_layernorm": norms[i](embeds)}
            for name, x in proxies.items():
                pred = block.route(block.gate(x))[1].long()
                hit = int((pred[:, :, None] == true[:, None, :]).any(-1).sum())
                for key in (name, f"{name}@layer{i}"):
                    acc = hits.setdefault(key, [0, 0])
                    acc[0], acc[1] = acc[0] + hit, acc[1] + true.numel()
    for h in hooks:
        h.remove()
    k, e = blocks[0].top_k, blocks[0].gate.out_features
    report = dict(model=str(args.model), windows=args.windows, length=args.length, chance=k / e,
                  recall={name: round(h / n, 4) for name, (h, n) in sorted(hits.items())})
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
