"""Slot decode attention (moeflow.kernels.attention.slot, interpreter: TRITON_INTERPRET=1): the kernel that
reads the server's KV rows in place gives its fp32 reference's outputs across GQA ratios 1/4/8, D 32/64/128,
repeated rows (padding copies), holes in ``valid``, sliding windows, gpt-oss sinks, key lengths off the block and
several (also empty) splits; the reference is the view's gather + mask + SDPA path; ``SlotDecodeView.attend``
stays off on the CPU by default, and forced on, the engine's decode passes over the view give the same greedy
tokens as without it.

Tolerances (max |difference|, outputs up to ~3.5): fp32 inputs 5e-6 (seen: 5e-7; exp2 and the split order against
torch's softmax); bf16 inputs 2e-2 (seen: 4e-3; the reference takes the same bf16 keys in fp32, the kernel's output
is rounded to bf16, one ulp of values up to 4 being 2^-6; on a GPU the probabilities are also rounded to bf16 for
the value dot).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from moeflow import MoEOffloadedMixtral
from moeflow.cli import embedded_model_path
from moeflow.engine.continuous import ContinuousEngine, SamplingParams
from moeflow.engine.kv_slots import SlotDecodeView, SlotKVCache
from moeflow.families.gpt_oss_layers import sink_attention
from moeflow.kernels.attention.slot import default_splits, slot_attention, slot_attention_reference

FP32 = dict(rtol=0, atol=5e-6)
BF16 = dict(rtol=0, atol=2e-2)
TIMEOUT_S = 300


def inputs(heads: int, kv_heads: int, d: int, dtype: torch.dtype, max_len: int = 300, key_len: int = 250,
           seed: int = 0, holes: float = 0.3):
    """q [5, heads, 1, D] over 4 cache rows (rows 2 and 0 twice; token 2 a padding copy of token 0), valid with
    holes, positions below key_len (one at key_len - 1, one at 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(5, heads, 1, d, generator=gen).to(dtype)
    q[2] = q[0]  # token 2 is token 0's padding copy
    k = torch.randn(4, kv_heads, max_len, d, generator=gen).to(dtype)
    v = torch.randn(4, kv_heads, max_len, d, generator=gen).to(dtype)
    rows = torch.tensor([2, 0, 2, 3, 0])
    valid = torch.rand(4, max_len, generator=gen) > holes
    pos = torch.tensor([[key_len - 1], [17], [key_len - 1], [0], [key_len // 2]])
    return q, k, v, rows, valid, pos


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 4, 64), (8, 2, 128), (16, 2, 64), (8, 1, 32)],
                         ids=["mha-d64", "gqa4-d128", "gqa8-d64", "gqa8-d32"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_kernel_equals_the_reference_fp32(heads, kv_heads, d, window):
    q, k, v, rows, valid, pos = inputs(heads, kv_heads, d, torch.float32)
    want = slot_attention_reference(q, k, v, rows, valid, pos, 250, window)
    got = slot_attention(q, k, v, rows, valid, pos, 250, window, splits=3)  # 250: no multiple of 64 or 128
    assert got.dtype == torch.float32 and got.shape == (5, heads, 1, d)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got[0], got[2], rtol=0, atol=0)  # a padding copy: the same row, the same bits


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_every_split_count_gives_the_reference(splits):
    """key_len 200 at BLOCK_N 64: 8 splits of one block leave four programs with no key (their partials
    weigh 0)."""
    q, k, v, rows, valid, pos = inputs(8, 2, 32, torch.float32, key_len=200, seed=splits)
    want = slot_attention_reference(q, k, v, rows, valid, pos, 200, None)
    torch.testing.assert_close(slot_attention(q, k, v, rows, valid, pos, 200, None, splits=splits), want, **FP32)


@pytest.mark.parametrize("window", [None, 16])
def test_sinks_join_the_denominator_as_gpt_oss_attention(window):
    q, k, v, rows, valid, pos = inputs(8, 2, 64, torch.float32, key_len=130, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 3
    want = slot_attention_reference(q, k, v, rows, valid, pos, 130, window, sinks, scale=0.125)
    got = slot_attention(q, k, v, rows, valid, pos, 130, window, sinks, scale=0.125, splits=2)
    torch.testing.assert_close(got, want, **FP32)
    plain = slot_attention_reference(q, k, v, rows, valid, pos, 130, window, scale=0.125)
    assert (want - plain).abs().max() > 1e-3  # the sinks took a share


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(32, 8, 128), (8, 8, 64)], ids=["mixtral", "mha-d64"])
def test_kernel_equals_the_reference_bf16(heads, kv_heads, d):
    q, k, v, rows, valid, pos = inputs(heads, kv_heads, d, torch.bfloat16, key_len=190, seed=5)
    got = slot_attention(q, k, v, rows, valid, pos, 190, 64, splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), slot_attention_reference(q, k, v, rows, valid, pos, 190, 64), **BF16)


@pytest.mark.parametrize("window", [None, 24])
def test_the_reference_is_the_views_gather_mask_and_sdpa(window):
    """The decode view's today's path (update's gather, attention_mask, SDPA) and the reference agree: the kernel
    computes what the server computed before it."""
    cache = SlotKVCache(2, 4, 96, 2, 32, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(7)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.valid.copy_(torch.rand(4, 96, generator=gen) > 0.2)
    view = cache.decode_view(4, 80)
    view.load(torch.tensor([1, 3, 0, 1]), torch.tensor([0, 1, 2, 0]))
    pos = torch.tensor([[70], [5], [79], [70]])
    q, k, v = torch.randn(4, 8, 1, 32, generator=gen), *torch.randn(2, 4, 2, 1, 32, generator=gen)
    k_all, v_all = view.update(1, k, v, pos)
    mask = view.attention_mask(pos, window)
    sdpa = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    ref = slot_attention_reference(q, cache.k[1], cache.v[1], view.rows, cache.valid, pos, 80, window)
    torch.testing.assert_close(ref, sdpa, **FP32)
    sinks = torch.randn(8, generator=gen)
    with_sinks = slot_attention_reference(q, cache.k[1], cache.v[1], view.rows, cache.valid, pos, 80, window, sinks)
    torch.testing.assert_close(with_sinks, sink_attention(q, k_all, v_all, mask, sinks, 32 ** -0.5), **FP32)


def test_attend_is_off_on_the_cpu_and_forced_on_writes_as_update(monkeypatch):
    cache = SlotKVCache(1, 3, 64, 2, 32, torch.float32, "cpu")
    view = cache.decode_view(2, 64)
    view.load(torch.tensor([2, 0]), torch.tensor([0, 1]))
    pos = torch.tensor([[9], [30]])
    cache.valid[[2, 0], :31] = True
    gen = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(2, 4, 1, 32, generator=gen), *torch.randn(2, 2, 2, 1, 32, generator=gen)
    assert SlotDecodeView.attention_kernel == "auto"  # the tests' environment sets no MOEFLOW_SLOT_ATTENTION
    assert view.attend(0, q, k, v, pos, None) is None and cache.k.abs().sum() == 0  # nothing written
    monkeypatch.setattr(SlotDecodeView, "attention_kernel", "triton")
    got = view.attend(0, q, k, v, pos, None)
    written = cache.k.clone(), cache.v.clone()
    k_all, v_all = view.update(0, k, v, pos)  # writes the same values again
    assert torch.equal(cache.k, written[0]) and torch.equal(cache.v, written[1])
    want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=view.attention_mask(pos, None), enable_gqa=True)
    torch.testing.assert_close(got, want, **FP32)
    monkeypatch.setattr(SlotDecodeView, "attention_kernel", "torch")
    assert view.attend(0, q, k, v, pos, None) is None


def test_default_splits_fill_an_h100_wave_from_shapes_only():
    assert default_splits(16, 8, 4096, 128) == 5  # Mixtral, 16 rows: 640 programs at 5 an SM, 0.97 of a wave
    assert default_splits(16, 8, 4096, 64) == 6  # gpt-oss: 768 programs at 6 an SM (7 would make 1.13 waves)
    assert default_splits(1, 8, 4096, 128) == 16  # one row: 256 keys a split at least
    assert default_splits(4, 8, 256, 128) == 1 and default_splits(16, 8, 100, 64) == 1


TEXT = b"The import statement combines two operations; it searches for the named module"
PROMPTS = [list(TEXT[:n]) for n in (7, 30, 61)]


def serve(model, views: bool, prompts: list[list[int]] = PROMPTS, max_len: int = 128) -> list[list[int]]:
    """Three requests at once (the decode batch 3 padded to 4: a padding copy) through the engine, its decode
    passes over SlotDecodeView run eagerly when ``views`` (what a captured step runs; no graph on the CPU)."""
    cache = SlotKVCache.for_model(model, max_len, max_rows=3)
    engine = ContinuousEngine(model, cache, prefill_chunk=64)
    if views:
        engine.graphs = types.SimpleNamespace(refused=None)  # the decode step takes _captured_pass's views
    engine.start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_new_tokens=5)) for p in prompts]
        return [s.result(TIMEOUT_S) for s in seqs]
    finally:
        engine.stop()


def served_with_the_kernel(model, monkeypatch, **kwargs) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """(tokens eagerly, tokens over the views with the kernel forced, whether each attend call took the kernel)."""
    calls = []
    kernel_attend = SlotDecodeView.attend

    def counted(self, *args, **kw):
        out = kernel_attend(self, *args, **kw)
        calls.append(out is not None)
        return out

    try:
        eager = serve(model, views=False, **kwargs)
        assert serve(model, views=True, **kwargs) == eager  # the views' own path (the kernel off on the CPU)
        with monkeypatch.context() as m:
            m.setattr(SlotDecodeView, "attention_kernel", "triton")
            m.setattr(SlotDecodeView, "attend", counted)
            forced = serve(model, views=True, **kwargs)
    finally:
        model.close()
    return eager, forced, calls


def test_engine_decode_with_the_kernel_gives_the_same_tokens(monkeypatch):
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path())
    layers = model.config.num_hidden_layers
    eager, forced, calls = served_with_the_kernel(model, monkeypatch)
    assert forced == eager
    assert calls and all(calls) and len(calls) % layers == 0 and len(calls) >= 4 * layers  # every decode layer


def test_gpt_oss_decode_with_the_kernel_gives_the_same_tokens(monkeypatch, tmp_path):
    """Sinks and gpt-oss's sliding-window layers (window 4) through SinkAttention's attend."""
    from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

    from moeflow import MoEModel

    model = MoEModel.from_pretrained(save_gpt_oss_checkpoint(make_gpt_oss_model(seed=4), tmp_path), kernels="torch")
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]
    eager, forced, calls = served_with_the_kernel(model, monkeypatch, prompts=prompts, max_len=64)
    assert forced == eager
    assert calls and all(calls)
