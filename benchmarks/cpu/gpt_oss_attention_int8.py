"""gpt-oss on the CPU path: what the attention projections on the file's Q8_0 blocks (``attention_bits="auto"``,
the default), or int8 per row (``attention_bits=8``), change against fp32 attention (``attention_bits=None``), all
beside the fp32 reference (``kernels="torch"``: dequantized MXFP4 experts, fp32 everything). No trained gpt-oss fits
here, so the model is the peer benchmark's synthetic GGUF (random weights, H = I = 2880, 2 layers x 8 experts;
``benchmarks/peers/gpt_oss_mxfp4_cpu.py`` writes it): logit deviation (relative L2, teacher-forced on the
reference's greedy paths) and greedy tokens on random prompts.

    python -m benchmarks.cpu.gpt_oss_attention_int8 --gguf /tmp/s16_gpt_oss/gpt-oss-mxfp4-synth-L2-E8.gguf \\
        --out benchmarks/results/cpu_attention_default/gpt_oss_synth.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moeflow import MoEModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(3, 90, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=[])
    with torch.inference_mode():
        ref = MoEModel.from_pretrained(args.gguf, device="cpu", dtype=torch.float32, kernels="torch", progress=False)
        paths = ref.generate(ids, **kw)
        want = ref(paths).logits[:, args.prompt_len - 1:-1].float()
        del ref
        rows = []
        for label, bits in (("fp32 (`attention_bits=None`)", None),
                            ("**the file's Q8_0 (`\"auto\"`, the default)**", "auto"),
                            ("int8 per row of the dequantized Q8_0 (`attention_bits=8`)", 8)):
            m = MoEModel.from_pretrained(args.gguf, device="cpu", dtype=torch.float32, attention_bits=bits,
                                         progress=False)
            got = m(paths).logits[:, args.prompt_len - 1:-1].float()
            dev = ((got - want).norm() / want.norm()).item()
            out = m.generate(ids, **kw)
            new, ref_new = out[:, args.prompt_len:], paths[:, args.prompt_len:]
            prompts_equal = int((new == ref_new).all(1).sum())
            first = new.shape[1] if prompts_equal == args.prompts else int((new != ref_new).int().argmax(1).min())
            rows.append(f"| {label} | {100 * dev:.2f}% | {prompts_equal}/{args.prompts} | "
                        f"{100 * (new == ref_new).float().mean().item():.1f}% | {first} |")
            del m
    lines = [f"# gpt-oss (synthetic, {args.gguf.name}): quantized vs fp32 attention on the CPU path\n",
             f"{args.prompts} random prompts of {args.prompt_len} tokens, {args.new} greedy tokens; reference: "
             "kernels=\"torch\" (fp32, dequantized experts). Random weights: no held-out text measure.\n",
             "| CPU path, attention | logit dev. (rel. L2, teacher-forced) | prompts with all tokens equal | "
             "positions equal | first differing position (min) |", "| --- | --- | --- | --- | --- |", *rows]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
