"""Quantize the trained tiny Mixtral into the package (moeflow/data/tiny-mixtral-awq) and measure what 4 bits cost.

    python -m scripts.train_tiny_model --out build/tiny-mixtral-fp32      # ~10 minutes on 2 cores
    python -m scripts.build_embedded_model --src build/tiny-mixtral-fp32 --group-size 32

Replaces the whole directory, so rebuild what derives from the model afterwards:
`scripts/build_embedded_predictors.py` and `scripts/build_expertflow_predictor.py` (predictors/), then the
tables (`scripts/predictor_table.py`, `scripts/policy_table.py`, `scripts/expertflow_table.py`).

Writes the AWQ checkpoint with `moeflow quantize` and a `report.json` beside it: held-out bits/byte of the
fp32 model and of the AWQ model (torch reference and the CPU int4 path), per-layer expert usage, and the
training report. Held-out text is the training script's own held-out split.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from moeflow import MoEOffloadedMixtral
from moeflow.tools.quantize import quantize_checkpoint
from scripts.train_tiny_model import collect_corpus, split_corpus

ROOT = Path(__file__).resolve().parents[1]

DEST = ROOT / "moeflow" / "data" / "tiny-mixtral-awq"


# Chat: a byte vocabulary has no special tokens, so turns end with the control byte ETX ("end of text", id 3),
# which no training text contains; generation_config.json lists it as the EOS, and tokenizer.json declares it a
# special token under its byte-level name "\u0103" (so transformers' tokenizer maps eos_token to id 3, not a new
# id). The model never learned to emit it: replies run to max_tokens or a stop string, but chat has a template.
END_OF_TURN = 3
END_OF_TURN_TEXT = "\u0103"  # the ByteLevel pre-tokenizer's character for byte 3
CHAT_TEMPLATE = (
    "{% if tools %}### tools\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('role ' ~ message['role'] ~ ' is not one of system, user, assistant, tool') }}"
    "{% endif %}"
    "### {{ message['role'] }}\n{{ message['content'] or '' }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "bos_token": None,
                    "eos_token": END_OF_TURN_TEXT, "clean_up_tokenization_spaces": False,
                    "chat_template": CHAT_TEMPLATE}


@torch.inference_mode()
def heldout_stats(model: MoEOffloadedMixtral, heldout: torch.Tensor, seq_len: int, windows: int) -> dict:
    """Bits per byte over `windows` held-out windows, and each layer's expert usage shares."""
    from moeflow.tools.record import TraceRecorder

    n_layers = len(model.model.moe_blocks)
    counts = torch.zeros(n_layers, model.config.num_local_experts)
    nll, n = 0.0, 0
    step = max(1, (heldout.numel() - seq_len - 1) // windows)
    for i in range(windows):
        w = heldout[i * step : i * step + seq_len + 1]
        with TraceRecorder(model) as rec:
            logits = model(w[None, :-1]).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
        n += seq_len
        for li in range(n_layers):
            ids = rec.steps[-1]["topk"][li].reshape(-1)
            counts[li] += torch.bincount(ids.long(), minlength=counts.shape[1]).float()
    share = counts / counts.sum(dim=1, keepdim=True)
    entropy = -(share * share.clamp_min(1e-12).log()).sum(dim=1) / math.log(share.shape[1])
    return {"bits_per_byte": nll / n / math.log(2), "tokens": n, "usage_share": share.round(decimals=4).tolist(),
            "usage_entropy_fraction": entropy.round(decimals=4).tolist()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=str(ROOT / "build" / "tiny-mixtral-fp32"))
    p.add_argument("--dst", default=str(DEST))
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128])
    p.add_argument("--windows", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    _, heldout_bytes = split_corpus(collect_corpus()[0])
    heldout = torch.frombuffer(bytearray(heldout_bytes), dtype=torch.uint8).long()

    dst = quantize_checkpoint(args.src, args.dst, group_size=args.group_size, overwrite=True, progress=False)
    report = {"source": str(Path(args.src).relative_to(ROOT)) if Path(args.src).is_relative_to(ROOT) else args.src,
              "group_size": args.group_size, "heldout_windows": args.windows, "seq_len": args.seq_len}
    fp32 = MoEOffloadedMixtral.from_pretrained(args.src, kernels="torch")
    report["fp32"] = heldout_stats(fp32, heldout, args.seq_len, args.windows)
    for kernels in ("torch", "cpu-int4"):
        awq = MoEOffloadedMixtral.from_pretrained(dst, kernels=kernels)
        report[f"awq_{kernels}"] = {k: v for k, v in heldout_stats(awq, heldout, args.seq_len, args.windows).items()
                                    if k in ("bits_per_byte", "tokens")}
    # a 3M-parameter byte model repeats itself under greedy decoding; sample by default, as many published
    # checkpoints do (callers override with do_sample=False)
    gen = {"do_sample": True, "temperature": 0.5, "top_k": 40, "top_p": 1.0, "max_new_tokens": 96,
           "eos_token_id": END_OF_TURN}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (dst / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    tokenizer = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["added_tokens"] = [{"id": END_OF_TURN, "content": END_OF_TURN_TEXT, "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": False, "special": True}]
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2), encoding="utf-8")
    training = Path(args.src) / "training_report.json"
    if training.is_file():
        shutil.copy2(training, dst / "training_report.json")
    (dst / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = sum(f.stat().st_size for f in dst.iterdir())
    print(f"wrote {dst} ({size / 2**20:.2f} MiB)")
    print(f"held-out bits/byte: fp32 {report['fp32']['bits_per_byte']:.3f}, "
          f"AWQ g{args.group_size} {report['awq_torch']['bits_per_byte']:.3f} (torch), "
          f"{report['awq_cpu-int4']['bits_per_byte']:.3f} (cpu-int4)")
    print("per-layer usage entropy / max:", report["fp32"]["usage_entropy_fraction"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
