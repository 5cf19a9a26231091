"""MLA's absorbed decode attention read in place (moeflow.kernels.attention.latent, interpreter:
TRITON_INTERPRET=1): the kernel that reads the server's latent rows gives its fp32 reference's contexts across 1 to
128 heads (one, two and three head tiles; heads not a multiple of the tile), latent widths off a power of two, a
cache wider than the attention's columns (DSA's indexer keys after them), rows out of order with padding copies,
holes in ``valid``, DSA's selection, key lengths off the block and several (also empty) splits; the reference is
``LatentAttention.absorbed`` over the decode view's gather and mask; ``LatentSlotDecodeView`` keeps the gather on
the CPU by default, and forced on, the engine's decode passes give the same greedy tokens for a tiny DeepSeek-V3 and
a tiny GLM-5 (DSA) as without it.

Tolerances (max |difference|, contexts up to ~3): fp32 5e-6 (seen: 3e-7; exp2 and the split order against torch's
softmax); bf16 2e-2 (seen: 4e-3; the reference takes the same bf16 latents in fp32, the kernel's output is rounded
to bf16; on a GPU the probabilities are also rounded to bf16 for the value dot, as the torch path does).
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from moeflow.engine.kv_slots import LatentSlotDecodeView, LatentSlotKVCache, SlotDecodeView
from moeflow.families.mla import LatentAttention, MLAShape
from moeflow.kernels.attention.latent import default_splits, latent_attention, latent_attention_reference

FP32 = dict(rtol=0, atol=5e-6)
BF16 = dict(rtol=0, atol=2e-2)
TIMEOUT_S = 300


def inputs(heads: int, rank: int, rope: int, dtype: torch.dtype, extra: int = 0, max_len: int = 200,
           key_len: int = 150, seed: int = 0, holes: float = 0.3):
    """query [5, heads, 1, rank + rope] over 4 cache rows of latents [4, max_len, rank + rope + extra] (rows 2 and 0
    twice, out of order; token 2 a padding copy of token 0), valid with holes, positions below key_len (one at
    key_len - 1, one at 0), and a DSA-like selection [5, key_len] that keeps each query's own key."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(5, heads, 1, rank + rope, generator=gen).to(dtype)
    q[2] = q[0]
    latents = torch.randn(4, max_len, rank + rope + extra, generator=gen).to(dtype)
    rows = torch.tensor([2, 0, 2, 3, 0])
    valid = torch.rand(4, max_len, generator=gen) > holes
    pos = torch.tensor([[key_len - 1], [17], [key_len - 1], [0], [key_len // 2]])
    select = torch.rand(5, key_len, generator=gen) > 0.5
    select[torch.arange(5), pos[:, 0]] = True
    select[2] = select[0]
    return q, latents, rows, valid, pos, select


@pytest.mark.parametrize(("heads", "rank", "rope"), [(1, 32, 16), (8, 32, 16), (16, 24, 8), (20, 16, 8),
                                                     (128, 32, 16)],
                         ids=["h1", "h8", "h16-r24", "h20-two-tiles", "h128-two-tiles"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "dsa"])
def test_kernel_equals_the_reference_fp32(heads, rank, rope, sparse):
    q, latents, rows, valid, pos, select = inputs(heads, rank, rope, torch.float32, extra=8)
    select = select if sparse else None
    want = latent_attention_reference(q, latents, rows, valid, pos, 150, rank, 0.3, select)
    got = latent_attention(q, latents, rows, valid, pos, 150, rank, 0.3, select, splits=3)  # 150: off the block
    assert got.dtype == torch.float32 and got.shape == (5, heads, 1, rank)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got[0], got[2], rtol=0, atol=0)  # a padding copy: the same row, the same bits
    if sparse:
        dense = latent_attention_reference(q, latents, rows, valid, pos, 150, rank, 0.3)
        assert (want - dense).abs().max() > 1e-2  # the selection took keys away


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_every_split_count_gives_the_reference(splits):
    """key_len 128 at BLOCK_N 16 (fp32): 8 splits of one block each; key_len 100 leaves the last splits short or
    empty (their partials weigh 0)."""
    for key_len in (128, 100):
        q, latents, rows, valid, pos, _ = inputs(8, 16, 8, torch.float32, key_len=key_len, seed=splits)
        want = latent_attention_reference(q, latents, rows, valid, pos, key_len, 16, 0.25)
        got = latent_attention(q, latents, rows, valid, pos, key_len, 16, 0.25, splits=splits)
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize(("heads", "rank", "rope"), [(16, 64, 16), (40, 32, 16)], ids=["h16", "h40"])
def test_kernel_equals_the_reference_bf16(heads, rank, rope):
    q, latents, rows, valid, pos, select = inputs(heads, rank, rope, torch.bfloat16, key_len=96, seed=5)
    for sel in (None, select):
        got = latent_attention(q, latents, rows, valid, pos, 96, rank, rank ** -0.5, sel, splits=2)
        assert got.dtype == torch.bfloat16
        want = latent_attention_reference(q, latents, rows, valid, pos, 96, rank, rank ** -0.5, sel)
        torch.testing.assert_close(got.float(), want, **BF16)


def tiny_mla(seed: int, heads: int = 4, rank: int = 16, rope: int = 8) -> LatentAttention:
    """A LatentAttention of plain fp32 linears (YaRN-like softmax scale) with random weights."""
    shape = MLAShape(hidden_size=32, num_heads=heads, q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=12,
                     qk_rope_head_dim=rope, v_head_dim=10, softmax_scale=0.37)
    torch.manual_seed(seed)
    layer = LatentAttention(shape, 1, lambda name, fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False),
                            torch.float32)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    return layer


def latent_view(extra: int = 0, seed: int = 7) -> tuple[LatentSlotKVCache, LatentSlotDecodeView, torch.Tensor]:
    """A latent cache (2 layers, 4 rows of 96, latent 16 + 8 (+ extra)) of random latents with holes, its
    decode view over rows [1, 3, 0, 1] (token 3 a padding copy of token 0) reading 80 keys, and the positions."""
    cache = LatentSlotKVCache(2, 4, 96, 24 + extra, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.latent.normal_(generator=gen)
    cache.valid.copy_(torch.rand(4, 96, generator=gen) > 0.2)
    view = cache.decode_view(4, 80)
    view.load(torch.tensor([1, 3, 0, 1]), torch.tensor([0, 1, 2, 0]))
    return cache, view, torch.tensor([[70], [5], [79], [70]])


def test_the_reference_is_the_views_gather_mask_and_absorbed():
    """The decode view's path today (update_latent's gather, attention_mask, LatentAttention.absorbed) and the
    reference agree: the kernel computes what the server computed before it."""
    layer = tiny_mla(1)
    cache, view, pos = latent_view()
    gen = torch.Generator().manual_seed(9)
    q_nope, q_rope = torch.randn(4, 4, 1, 12, generator=gen), torch.randn(4, 4, 1, 8, generator=gen)
    latents = view.update_latent(1, torch.randn(4, 1, 24, generator=gen), pos)
    torch_path = layer.absorbed(q_nope, q_rope, latents, view.attention_mask(pos, None))
    query = layer.absorb_query(q_nope, q_rope)
    ref = latent_attention_reference(query, cache.latent[1], view.rows, cache.valid, pos, 80, 16, 0.37)
    torch.testing.assert_close(layer.absorb_output(ref), torch_path, **FP32)


def test_in_place_is_off_on_the_cpu_and_forced_on_writes_as_update_latent(monkeypatch):
    layer = tiny_mla(2)
    cache, view, pos = latent_view(extra=6)  # DSA-like: 6 columns after the attention's
    gen = torch.Generator().manual_seed(10)
    q_nope, q_rope = torch.randn(4, 4, 1, 12, generator=gen), torch.randn(4, 4, 1, 8, generator=gen)
    latent = torch.randn(4, 1, 30, generator=gen)
    assert SlotDecodeView.attention_kernel == "auto"  # the tests' environment sets no MOEFLOW_SLOT_ATTENTION
    assert not layer.in_place(view, q_nope) and not layer.in_place(object(), q_nope)
    monkeypatch.setattr(SlotDecodeView, "attention_kernel", "triton")
    assert layer.in_place(view, q_nope) and not layer.in_place(view, q_nope.double())
    assert not layer.in_place(view, torch.randn(4, 4, 2, 12))  # a prefill chunk: never
    view.write_latent(1, latent, pos)
    got = layer.absorbed_in_place(view, q_nope, q_rope, pos)
    written = cache.latent.clone()
    latents = view.update_latent(1, latent, pos)  # writes the same values again
    assert torch.equal(cache.latent, written)
    mask = view.attention_mask(pos, None)
    torch.testing.assert_close(got, layer.absorbed(q_nope, q_rope, latents[..., :24], mask), **FP32)
    torch.testing.assert_close(view.latent_columns(1, 24), latents[..., 24:], rtol=0, atol=0)
    select = torch.rand(4, 1, 1, 80, generator=gen) > 0.4
    select[torch.arange(4), 0, 0, pos[:, 0]] = True
    select[3] = select[0]
    sparse = layer.absorbed_in_place(view, q_nope, q_rope, pos, select)
    torch.testing.assert_close(sparse, layer.absorbed(q_nope, q_rope, latents[..., :24], mask & select), **FP32)
    monkeypatch.setattr(SlotDecodeView, "attention_kernel", "torch")
    assert not layer.in_place(view, q_nope)


def test_default_splits_fill_an_h100_wave_from_shapes_only():
    assert default_splits(16, 2, 4096, 64) == 4  # DeepSeek-V3, 16 rows: 128 programs at 1 an SM, 0.97 of a wave
    assert default_splits(1, 2, 4096, 64) == 32  # one row: 128 keys a split at least
    assert default_splits(16, 1, 4096, 32) == 8  # 20 heads (one tile of 32): 128 programs at 1 an SM
    assert default_splits(16, 1, 4096, 16) == 15  # 16 heads: 240 programs at 2 an SM
    assert default_splits(4, 2, 128, 64) == 1


# ------------------------------------------------------------------ the engine's decode passes
def serve(model, views: bool, prompts: list[list[int]]) -> list[list[int]]:
    """Three requests at once (the decode batch 3 padded to 4: a padding copy) through the engine, its decode
    passes over LatentSlotDecodeView run eagerly when ``views`` (what a captured step runs; no graph on the CPU)."""
    from moeflow.engine.continuous import ContinuousEngine, SamplingParams
    from moeflow.engine.kv_slots import SlotKVCache

    cache = SlotKVCache.for_model(model, 64, max_rows=3)
    assert isinstance(cache, LatentSlotKVCache)
    engine = ContinuousEngine(model, cache, prefill_chunk=8)
    if views:
        engine.graphs = types.SimpleNamespace(refused=None)  # the decode step takes _captured_pass's views
    engine.start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        return [s.result(TIMEOUT_S) for s in seqs]
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa"])
def test_engine_decode_with_the_kernel_gives_the_same_tokens(tmp_path, monkeypatch, kind):
    """DeepSeek-V3 (YaRN's softmax scale) and GLM-5 (DSA: its selection in the kernel, shared-indexer layers,
    prompts past index_topk 6): the decode passes with the kernel forced give the tokens of the gather."""
    from tiny_dsa import GLM_MOE_DSA, make_dsa_checkpoint
    from tiny_families import DEEPSEEK_V3, make_checkpoint

    from moeflow import MoEModel

    if kind == "deepseek_v3":
        path = make_checkpoint(tmp_path, kind, seed=21, **DEEPSEEK_V3["yarn-halves-rope"])[0]
    else:
        path = make_dsa_checkpoint(tmp_path, kind, seed=21, **GLM_MOE_DSA["shared-indexers-dense"])[0]
    model = MoEModel.from_pretrained(path, kernels="torch")
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 15)]
    calls = []
    kernel_attend = LatentSlotDecodeView.attend_latent

    def counted(self, *args, **kw):
        calls.append(1)
        return kernel_attend(self, *args, **kw)

    try:
        eager = serve(model, False, prompts)
        assert serve(model, True, prompts) == eager  # the views' own path (the kernel off on the CPU)
        assert not calls
        with monkeypatch.context() as m:
            m.setattr(SlotDecodeView, "attention_kernel", "triton")
            m.setattr(LatentSlotDecodeView, "attend_latent", counted)
            forced = serve(model, True, prompts)
    finally:
        model.close()
    assert forced == eager
    layers = model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0 and len(calls) >= 4 * layers  # every layer of every decode pass
