"""GGUF Q4_0 files of the GPU lane's synthetic checkpoints, for llama.cpp (``llama-bench --n-cpu-moe``) beside
moeflow on the same weights: no bf16 model, no ``convert_hf_to_gguf.py``, no ``llama-quantize``. And a Q4_K_M
variant (``experts="Q4_K_M"``): the experts in llama-quantize's Q4_K_M mixture, random blocks, for llama.cpp and
moeflow on the same K-quant file (:func:`q4_k_m_experts`).

The AWQ writers (``common.checkpoint.write_synthetic_awq_checkpoint`` for Mixtral-8x7B, ``gpu.families.
write_family_checkpoint`` for Qwen3-30B-A3B) draw their random tensors from one seeded ``torch.Generator`` in a fixed
order; :func:`mixtral_parts` / :func:`qwen3_parts` draw the same tensors in the same order (tests/test_gguf_lane.py
checks them against the files those writers produce). Every AWQ linear they write has zero point 8 in every group,
so ``W = (q - 8) * scale`` with one fp16 scale per 128 inputs: exactly a Q4_0 block (32 inputs, ``(q - 8) * d``,
fp16 ``d``) whose ``d`` is its group's scale, the same 4-bit codes. **The GGUF holds exactly the AWQ file's weights**
(a linear with another zero point is refused: :func:`awq_to_q4_0`). The fp16 tensors (embeddings, lm_head, the
router, Qwen3's attention) are stored F16 (the router and norms F32, as llama.cpp's converter does), values equal.
Mixtral's q/k rows are permuted as ``convert_hf_to_gguf.py`` does for the ``llama`` architecture (GGML's rope pairs
neighbouring dimensions, HF's the two halves), so llama.cpp computes the same function; Qwen3 (NEOX rope) is not.

Architectures: Mixtral as ``llama`` with ``expert_count`` 8 / ``expert_used_count`` 2, Qwen3-30B-A3B as ``qwen3moe``
(48 layers, 128 experts, top 8). Tokenizer: a synthetic SentencePiece-style (``llama``) vocabulary of the model's
size (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then ``▁t<i>``), which llama.cpp loads for any
architecture; llama-bench feeds token ids, never text. Experts are written as llama.cpp's stacked ``ffn_*_exps``
tensors ``[E, out, in]``. Streaming: the tensor infos first, then each tensor's bytes in order; the writers reuse
four random expert templates round-robin (with 8 or 128 experts per layer every layer's stacked tensor is the same
bytes), so writing is bound by the disk. Written to ``<name>.part`` and renamed when complete.

    python -m benchmarks.common.gguf_checkpoint --family mixtral --out /tmp/moeflow-mixtral-8x7b-Q4_0.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.checkpoint import MIXTRAL_8X7B, TEMPLATES, random_awq_linear
from moeflow.quant.awq import unpack_int4

Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # fp16 d + 16 bytes of nibbles


# ------------------------------------------------------------------------------------------ Q4_0
def awq_to_q4_0(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> np.ndarray:
    """One AWQ linear (qweight int32 [K, N/8], qzeros int32 [K/group, N/8], scales fp16 [K/group, N]) as Q4_0 rows:
    uint8 [N, K/32 * 18] (ggml's ``block_q4_0``: fp16 d, then byte j = q[j] | q[j + 16] << 4). Exact when every zero
    point is 8 (ValueError otherwise: Q4_0 is symmetric)."""
    if group % Q4_0_BLOCK:
        raise ValueError(f"AWQ group size {group} is not a multiple of Q4_0's block of {Q4_0_BLOCK}")
    zeros = unpack_int4(qzeros)
    if not bool((zeros == 8).all()):
        raise ValueError("AWQ zero points other than 8 are not representable in Q4_0 (symmetric blocks)")
    q = awq_codes(qweight).T.contiguous()  # [N, K]
    n, k = q.shape
    q = q.view(n, k // Q4_0_BLOCK, Q4_0_BLOCK)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]
    d = scales.to(torch.float16).T.repeat_interleave(group // Q4_0_BLOCK, dim=1).contiguous()  # [N, K/32]
    blocks = torch.cat([d.view(torch.uint8).view(n, k // Q4_0_BLOCK, 2), nibbles], dim=2)
    return blocks.reshape(n, k // Q4_0_BLOCK * Q4_0_BYTES).numpy()


def awq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """``unpack_int4`` in bytes: int32 [K, N/8] -> uint8 [K, N] codes in [0, 15] (a quarter of its memory traffic:
    little-endian byte b of each int32 holds nibbles 2b (low) and 2b + 1 (high); nibble i is column AWQ_ORDER[i], so
    the high (h = 1) or low nibble of byte 2i + j is column 4j + 2h + i)."""
    if sys.byteorder != "little":
        return unpack_int4(qweight).to(torch.uint8)
    k, n8 = qweight.shape
    b = qweight.contiguous().view(torch.uint8).view(k, n8, 2, 2)  # byte 2i + j at [.., i, j]
    low, high = (b & 0xF).transpose(-1, -2), (b >> 4).transpose(-1, -2)  # [.., j, i]
    return torch.stack([low, high], dim=3).reshape(k, n8 * 8)  # column 4j + 2h + i at [.., j, h, i]


def permute_rope_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute on the output rows of q/k (``rows`` [out, ...])."""
    out = rows.shape[0]
    return rows.reshape(n_head, 2, out // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _np(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    return t.to(dtype).contiguous().numpy()


# ------------------------------------------------------------------------------------------ the random tensors
def mixtral_parts(config: dict, group: int = 128, seed: int = 0) -> dict:
    """The tensors of ``write_synthetic_awq_checkpoint(config, group, seed)``, drawn in its order: ``templates``
    (TEMPLATES dicts w1/w3/w2 -> AWQ parts), ``attention`` (q/k/v/o -> AWQ parts), ``gates`` (one fp16 [E, H] per
    layer), ``embed`` and ``lm_head`` (fp16 [V, H])."""
    gen = torch.Generator().manual_seed(seed)
    H, I = config["hidden_size"], config["intermediate_size"]  # noqa: E741
    L, E, V = config["num_hidden_layers"], config["num_local_experts"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (H // config["num_attention_heads"])
    templates = [{w: random_awq_linear(*shape, group, gen) for w, shape in (("w1", (H, I)), ("w3", (H, I)),
                                                                            ("w2", (I, H)))} for _ in range(TEMPLATES)]
    attention = {p: random_awq_linear(H, out, group, gen) for p, out in (("q", H), ("k", kv), ("v", kv), ("o", H))}
    gates = [(torch.randn((E, H), generator=gen) * 0.02).half() for _ in range(L)]
    embed = (torch.randn((V, H), generator=gen) * 0.5).half()
    lm_head = (torch.randn((V, H), generator=gen) * 0.02).half()
    return {"templates": templates, "attention": attention, "gates": gates, "embed": embed, "lm_head": lm_head}


def qwen3_parts(cfg: dict, group: int = 128, seed: int = 0) -> dict:
    """The tensors of ``gpu.families.write_family_checkpoint(.., "qwen3_moe", cfg, group, seed)``, in its order:
    expert ``templates`` (gate_proj/up_proj/down_proj -> AWQ parts), fp16 ``attention`` (nn.Linear weights),
    ``gates`` per layer, ``embed``, ``lm_head``."""
    gen = torch.Generator().manual_seed(seed)
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]  # noqa: E741
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.float16)

    templates = [{p: random_awq_linear(*shape, group, gen) for p, shape in
                  (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H)))} for _ in range(TEMPLATES)]
    shapes = {"q_proj": (nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H), "o_proj": (H, nh * hd)}
    attention = {p: normal(s, 0.02) for p, s in shapes.items()}
    gates = [normal((E, H), 0.02) for _ in range(cfg["num_hidden_layers"])]
    embed = normal((cfg["vocab_size"], H), 0.5)
    lm_head = normal((cfg["vocab_size"], H), 0.02)
    return {"templates": templates, "attention": attention, "gates": gates, "embed": embed, "lm_head": lm_head}


def stacked_experts(templates: list[dict], names: tuple[str, str, str], num_experts: int, group: int
                    ) -> dict[str, np.ndarray]:
    """gate/up/down as llama.cpp's stacked Q4_0 tensors uint8 [E, out, in/32*18]: expert e of every layer is
    template e % TEMPLATES (the AWQ writers use (layer * E + e) % TEMPLATES, the same for E % TEMPLATES == 0)."""
    q4 = [{w: awq_to_q4_0(**parts, group=group) for w, parts in t.items()} for t in templates]
    return {gguf: np.stack([q4[e % len(q4)][w] for e in range(num_experts)])
            for gguf, w in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names, strict=True)}


# ------------------------------------------------------------------------------------------ Q4_K_M experts
QK_K = 256
K_BYTES = {"Q4_K": 144, "Q6_K": 210}
EXPERT_TYPES = ("Q4_0", "Q4_K_M")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (llama-quant.cpp): the layers whose ``ffn_down`` Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_k_blocks(type_name: str, rows: int, k: int, gen: torch.Generator) -> np.ndarray:
    """uint8 [rows, k / 256 * type size] of random ``Q4_K`` or ``Q6_K`` blocks (ggml-common.h's layouts) whose
    weights are about the AWQ writers' ((q - 8) * U(1e-3, 3e-3): std ~0.01, mean ~0): Q4_K random quants and
    6-bit scales / mins, ``d`` = U(1, 3)e-3 / 32 and ``dmin`` = 7.5 d (so ``d sc q - dmin m`` is centred on
    average); Q6_K random quants, int8 scales in [1, 16], ``d`` = U(0.5, 1.5)e-4."""
    if k % QK_K:
        raise ValueError(f"{type_name} rows need a multiple of {QK_K} inputs, got {k}")
    size = K_BYTES[type_name]
    blocks = torch.randint(0, 256, (rows, k // QK_K, size), generator=gen, dtype=torch.uint8)
    if type_name == "Q4_K":
        d = torch.rand((rows, k // QK_K), generator=gen) * 2e-3 / 32 + 1e-3 / 32
        blocks[..., 0:2] = d.half().view(torch.uint8).view(rows, -1, 2)
        blocks[..., 2:4] = (d * 7.5).half().view(torch.uint8).view(rows, -1, 2)
    else:
        blocks[..., 192:208] = torch.randint(1, 17, (rows, k // QK_K, 16), generator=gen, dtype=torch.uint8)
        d = torch.rand((rows, k // QK_K), generator=gen) * 1e-4 + 0.5e-4
        blocks[..., 208:210] = d.half().view(torch.uint8).view(rows, -1, 2)
    return blocks.reshape(rows, -1).numpy()


def q4_k_m_experts(num_experts: int, hidden: int, inter: int, seed: int) -> dict[str, np.ndarray]:
    """The stacked expert tensors of a Q4_K_M file, random blocks ([E, out, in/256 * size], expert e the template
    e % TEMPLATES): ``ffn_gate_exps`` / ``ffn_up_exps`` Q4_K, ``ffn_down_exps`` both forms, ``Q4_K`` and ``Q6_K``
    (llama-quantize's Q4_K_M puts the down projections of :func:`use_more_bits` layers in Q6_K)."""
    gen = torch.Generator().manual_seed(seed + 1)
    shapes = {"ffn_gate_exps": ("Q4_K", inter, hidden), "ffn_up_exps": ("Q4_K", inter, hidden),
              "Q4_K": ("Q4_K", hidden, inter), "Q6_K": ("Q6_K", hidden, inter)}
    out = {}
    for name, (t, rows, k) in shapes.items():
        templates = [random_k_blocks(t, rows, k, gen) for _ in range(TEMPLATES)]
        out[name] = np.stack([templates[e % TEMPLATES] for e in range(num_experts)])
    return out


# ------------------------------------------------------------------------------------------ the file
def synthetic_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary llama.cpp accepts: <unk> <s> </s>, the 256 byte tokens (only <0x0A>, which
    llama.cpp looks up at load, when ``size`` < 300: the tiny CPU models), then ▁t<i>."""
    from gguf import TokenType

    byte_values = range(256) if size >= 300 else [0x0A]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in byte_values]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * len(byte_values)
    if size < len(tokens):
        raise ValueError(f"vocab_size={size}: the synthetic vocabulary needs at least {len(tokens)} tokens")
    fixed = len(tokens)
    tokens += [f"\u2581t{i}" for i in range(size - fixed)]
    types += [TokenType.NORMAL] * (size - fixed)
    return tokens, [0.0] * fixed + [-float(i) for i in range(size - fixed)], [int(t) for t in types]


def _plan(family: str, config: dict, group: int, seed: int, experts_type: str = "Q4_0"
          ) -> tuple[str, dict, Iterator[tuple[str, Callable[[], np.ndarray], np.ndarray, str | None]]]:
    """(architecture, hyperparameters, tensors): each tensor as (name, producer of its bytes, an array of its
    shape and dtype, its ggml block type: None for F16 / F32)."""
    if experts_type not in EXPERT_TYPES:
        raise ValueError(f"experts={experts_type!r}: expected one of {EXPERT_TYPES}")
    if family == "mixtral":
        parts = mixtral_parts(config, group, seed)
        H, I, E = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]  # noqa: E741
        nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
        hd = H // nh
        hp = dict(arch="llama", hidden=H, ff=I, expert_ff=None, heads=nh, kv_heads=nkv, head_dim=hd,
                  experts=E, top_k=config["num_experts_per_tok"], eps=config["rms_norm_eps"],
                  rope=config["rope_theta"], ctx=config["max_position_embeddings"])
        names = ("w1", "w3", "w2")
        att = {"attn_q": ("q", nh), "attn_k": ("k", nkv), "attn_v": ("v", None), "attn_output": ("o", None)}
        attention = {}
        for gname, (p, heads) in att.items():
            rows = awq_to_q4_0(**parts["attention"][p], group=group)
            attention[gname] = permute_rope_rows(rows, heads) if heads else rows
        qk_norm = False
    elif family == "qwen3":
        parts = qwen3_parts(config, group, seed)
        H, E = config["hidden_size"], config["num_experts"]
        hd = config["head_dim"]
        hp = dict(arch="qwen3moe", hidden=H, ff=config["intermediate_size"], expert_ff=config["moe_intermediate_size"],
                  heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"], head_dim=hd,
                  experts=E, top_k=config["num_experts_per_tok"], eps=config["rms_norm_eps"],
                  rope=config["rope_theta"], ctx=config["max_position_embeddings"])
        names = ("gate_proj", "up_proj", "down_proj")
        attention = {g: _np(parts["attention"][p], torch.float16) for g, p in
                     (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))}
        qk_norm = True
    else:
        raise ValueError(f"family={family!r}: expected 'mixtral' or 'qwen3'")
    if experts_type == "Q4_0":
        experts = stacked_experts(parts["templates"], names, E, group)

        def layer_experts(layer: int) -> list[tuple[str, np.ndarray, str]]:
            return [(n, a, "Q4_0") for n, a in experts.items()]
    else:
        kq = q4_k_m_experts(E, H, hp["expert_ff"] or hp["ff"], seed)
        L = config["num_hidden_layers"]

        def layer_experts(layer: int) -> list[tuple[str, np.ndarray, str]]:
            down = "Q6_K" if use_more_bits(layer, L) else "Q4_K"
            return [("ffn_gate_exps", kq["ffn_gate_exps"], "Q4_K"), ("ffn_up_exps", kq["ffn_up_exps"], "Q4_K"),
                    ("ffn_down_exps", kq[down], down)]
    ones_h = np.ones(H, dtype=np.float32)
    ones_hd = np.ones(hd, dtype=np.float32)

    def tensors():
        def item(name: str, arr: np.ndarray, qtype: str | None = None, make: Callable[[], np.ndarray] | None = None):
            return name, (make or (lambda: arr)), arr, qtype

        embed = _np(parts["embed"], torch.float16)
        yield item("token_embd.weight", embed)
        for layer in range(config["num_hidden_layers"]):
            b = f"blk.{layer}"
            yield item(f"{b}.attn_norm.weight", ones_h)
            for gname, arr in attention.items():
                yield item(f"{b}.{gname}.weight", arr, "Q4_0" if arr.dtype == np.uint8 else None)
            if qk_norm:
                yield item(f"{b}.attn_q_norm.weight", ones_hd)
                yield item(f"{b}.attn_k_norm.weight", ones_hd)
            yield item(f"{b}.ffn_norm.weight", ones_h)
            gate = parts["gates"][layer]
            yield item(f"{b}.ffn_gate_inp.weight", np.empty(gate.shape, np.float32),
                       make=lambda g=gate: _np(g, torch.float32))
            for gname, arr, qtype in layer_experts(layer):
                yield item(f"{b}.{gname}.weight", arr, qtype)
        yield item("output_norm.weight", ones_h)
        yield item("output.weight", _np(parts["lm_head"], torch.float16))

    return hp["arch"], hp, tensors()


def write_synthetic_gguf(path: Path, family: str, config: dict, group: int = 128, seed: int = 0,
                         experts: str = "Q4_0") -> Path:
    """Write the GGUF of the synthetic ``family`` ("mixtral" or "qwen3") checkpoint of ``config`` (a file already
    there is reused). ``experts`` "Q4_0": the AWQ checkpoint's weights exactly; "Q4_K_M": the experts as
    llama-quantize's Q4_K_M stores them (gate / up Q4_K, down Q6_K in :func:`use_more_bits` layers else Q4_K), of
    random blocks (:func:`q4_k_m_experts`: not the AWQ weights; written without a bf16 model or llama-quantize,
    bound by the disk like the Q4_0 file), the other tensors as in the Q4_0 file."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    path = Path(path)
    if path.is_file():
        return path
    arch, hp, tensors = _plan(family, config, group, seed, experts)
    part = path.with_name(path.name + ".part")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(part, arch)
    w.add_name(f"moeflow synthetic {family}")
    w.add_context_length(hp["ctx"])
    w.add_embedding_length(hp["hidden"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(hp["ff"])
    if hp["expert_ff"]:
        w.add_expert_feed_forward_length(hp["expert_ff"])
    w.add_head_count(hp["heads"])
    w.add_head_count_kv(hp["kv_heads"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_rope_freq_base(float(hp["rope"]))
    w.add_layer_norm_rms_eps(float(hp["eps"]))
    w.add_expert_count(hp["experts"])
    w.add_expert_used_count(hp["top_k"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_Q4_0 if experts == "Q4_0" else LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(2)
    tokens, scores, types = synthetic_vocab(config["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    plan = list(tensors)
    for name, _, like, qtype in plan:
        w.add_tensor_info(name, like.shape, like.dtype, like.nbytes,
                          raw_dtype=GGMLQuantizationType[qtype] if qtype else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, make, _, _ in plan:
        w.write_tensor_data(make())
    w.close()
    return part.rename(path)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common.checkpoint import TINY as MIXTRAL_TINY
    from benchmarks.gpu.families import QWEN3_30B_A3B
    from benchmarks.gpu.families import TINY as FAMILY_TINY

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("mixtral", "qwen3"), default="mixtral")
    ap.add_argument("--tiny", action="store_true", help="the tiny CPU shapes (AWQ group 32)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", choices=EXPERT_TYPES, default="Q4_0")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.family == "mixtral":
        config = dict(MIXTRAL_TINY if args.tiny else MIXTRAL_8X7B)
    else:
        config = dict(FAMILY_TINY["qwen3_moe"] if args.tiny else QWEN3_30B_A3B)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    t0 = time.perf_counter()
    path = write_synthetic_gguf(args.out, args.family, config, group=32 if args.tiny else 128, experts=args.experts)
    done = {"path": str(path), "bytes": path.stat().st_size, "write_s": round(time.perf_counter() - t0, 1)}
    print(done, flush=True)
    return done


if __name__ == "__main__":
    main()
