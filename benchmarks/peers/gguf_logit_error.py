"""How far a GGUF's ``device="cpu"`` logits are from the fp32 reference of the same file (``kernels="torch"``: every
weight the file's dequantized value, fp32 activations), under the source tree on ``PYTHONPATH``: relative error
(norm) of each prompt's logits and the share of positions whose argmax agrees, over ``--prompts`` random prompts
of 16 tokens (one thread). Run it once per tree to compare two trees' numerics, e.g.

    S=$PWD/benchmarks/peers/gguf_logit_error.py
    for t in /work/wt/storedlin-before $PWD; do (cd $t && PYTHONPATH=$t python $S /tmp/peers/m-Q4_0.gguf); done

(run from inside the tree: ``python script`` puts the script's folder, not the working directory, first on the
path, and ``PYTHONPATH`` picks the tree).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from moeflow import MoEModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--prompts", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ref = MoEModel.from_pretrained(args.gguf, device="cpu", kernels="torch", dtype=torch.float32)
    vocab = ref.config.vocab_size
    prompts = [torch.randint(3, vocab, (1, 16), generator=gen) for _ in range(args.prompts)]
    with torch.inference_mode():
        want = [ref(ids).logits[0].float() for ids in prompts]
    ref.close()
    model = MoEModel.from_pretrained(args.gguf, device="cpu", dtype=torch.float32)
    errs, agree = [], []
    with torch.inference_mode():
        for ids, r in zip(prompts, want, strict=True):
            y = model(ids).logits[0].float()
            errs.append(((y - r).norm() / r.norm()).item())
            agree.append((y.argmax(-1) == r.argmax(-1)).float().mean().item())
    attn = model.model.layers[0].self_attn
    forms = {p: type(getattr(attn, p)).__name__ for p in ("q_proj", "k_proj", "v_proj", "o_proj") if hasattr(attn, p)}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"{args.gguf.name} ({cpu}): layer 0 attention {forms}, lm_head {type(model.model.lm_head).__name__}; "
          f"relative error per prompt {[round(e, 3) for e in errs]}, median {statistics.median(errs):.3f}; "
          f"argmax agreement {statistics.mean(agree):.3f}")
    model.close()


if __name__ == "__main__":
    main()
