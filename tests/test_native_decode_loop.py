"""Greedy batch-1 CPU decoding in native chunks (engine/native_decode.py, kernels/cpu/step_loop.c): the same tokens
as the per-token path (``MOEFLOW_NATIVE_LOOP=0``), each step's logits bit for bit the per-token step's, the KV cache
and its ``valid`` row left the same, at 1, 2 and 3 threads, on the embedded Mixtral, a tiny Qwen3-MoE, a tiny
gpt-oss (sliding-window layers) and a GGUF file's K-quant experts, head and embedding; EOS inside a chunk, one and
two new tokens, chunks crossed with and without a streamer (the same tokens in the same order), the stats set; and
the calls it steps aside from (sampling, a repetition penalty, a batch of two, an offloading policy, a hook, the
one-call step off, a GGUF Q8_0 embedding used as stored) run the plain loop; tied and NaN logits pick numpy's
index. ~15-25 s on 2 loaded cores."""

from __future__ import annotations

import pytest
import torch

import moeflow.engine.cpu_layers as cpu_layers
import moeflow.engine.cpu_layers_gpt_oss as cpu_layers_gpt_oss
import moeflow.engine.native_decode as native_decode
from moeflow import MoEModel, OffloadConfig
from moeflow.cli import embedded_model_path
from moeflow.kernels.cpu.native import native_available
from moeflow.tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels cannot be built here")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The embedded model (int4 attention, int8 lm_head), a tiny Qwen3-MoE (QK-norm; AWQ attention) and a tiny
    gpt-oss (MXFP4 experts; sliding-window layers of window 4 beside full-attention ones, sink attention)."""
    from family_models import make_family_checkpoint
    from gpt_oss_helpers import make_gpt_oss_model, save_gpt_oss_checkpoint

    root = tmp_path_factory.mktemp("native_loop")
    src = make_family_checkpoint(root / "qwen3", "qwen3_moe", seed=7, hidden_size=128, moe_intermediate_size=128,
                                 intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    qwen3 = quantize_checkpoint(src, root / "qwen3_awq", group_size=32, quantize_attention=True, progress=False)
    out = {"embedded": MoEModel.from_pretrained(embedded_model_path(), device="cpu", attention_bits=4,
                                                lm_head_bits=8),
           "qwen3_moe": MoEModel.from_pretrained(qwen3, device="cpu"),
           "gpt_oss": MoEModel.from_pretrained(save_gpt_oss_checkpoint(
               make_gpt_oss_model(seed=12, num_hidden_layers=3, intermediate_size=96, vocab_size=112),
               root / "gpt_oss", mxfp4=True), device="cpu", dtype=torch.float32)}
    yield out
    for m in out.values():
        m.close()


@pytest.fixture
def chunks(monkeypatch):
    """Every native chunk: (its tokens, its logits fp32 [n, V]: every step's, as the loop computed them)."""
    seen = []
    inner = native_decode.decode_chunk

    def chunk(parts, embed, cos, sin, windows, valid, pos, token, eos, n, logits=None):
        logits = torch.empty((n, parts.head.head.n))
        tokens, times = inner(parts, embed, cos, sin, windows, valid, pos, token, eos, n, logits)
        assert len(times) == len(tokens) + 1 and times == sorted(times)
        seen.append((tokens, logits[:len(tokens)].clone()))
        return tokens, times
    monkeypatch.setattr(native_decode, "decode_chunk", chunk)
    return seen


@pytest.fixture
def steps(monkeypatch):
    """Every per-token one-call step with a tail (the Mixtral-layout one, gpt-oss's): its logits [V]."""
    seen = []
    for module, name in ((cpu_layers, "layers_step"), (cpu_layers_gpt_oss, "gpt_oss_step")):
        inner = getattr(module, name)

        def step(*a, inner=inner, **kw):
            out = inner(*a, **kw)
            if kw.get("head") is not None:
                seen.append(kw["logits"].reshape(-1).clone())
            return out
        monkeypatch.setattr(module, name, step)
    return seen


class Streamer:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, ids: torch.Tensor) -> None:
        self.puts.append(ids.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


def _run(model, ids, native: bool, monkeypatch, n: int = 8, keep_cache: list | None = None, **kw) -> torch.Tensor:
    monkeypatch.setenv(native_decode.NATIVE_LOOP_ENV, "1" if native else "0")
    runner = model._runner
    if keep_cache is not None:  # the generate call's KV cache, to compare what it leaves
        new_cache = runner.new_cache
        runner.new_cache = lambda *a, **k: keep_cache.append(new_cache(*a, **k)) or keep_cache[-1]
    model.stats.reset()
    try:
        with torch.inference_mode():
            kw = {"do_sample": False, "eos_token_id": [], **kw}
            return model.generate(ids, max_new_tokens=n, **kw)
    finally:
        if keep_cache is not None:
            del runner.new_cache


def _ids(seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (batch, 5), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["embedded", "qwen3_moe", "gpt_oss"])
def test_the_native_loop_is_the_per_token_path_on_1_2_3_threads(models, kind, chunks, steps, monkeypatch):
    """gpt-oss: 5 prompt tokens and 9 decode steps cross its window of 4 (each layer's own mask)."""
    model, ids, n = models[kind], _ids(4), 10
    ref_cache: list = []
    ref = _run(model, ids, False, monkeypatch, n, ref_cache)
    ref_logits = list(steps)
    assert not chunks and len(ref_logits) == n - 1  # every decode step took the per-token one-call step
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            chunks.clear()
            steps.clear()
            cache: list = []
            out = _run(model, ids, True, monkeypatch, n, cache)
            assert torch.equal(out, ref), f"{t} threads"
            assert len(chunks) == 1 and not steps  # every decode step in one native call
            tokens, logits = chunks[0]
            assert tokens == out[0, ids.shape[1] + 1:].tolist()
            assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True)), f"{t} threads"
            (c,), (r,) = cache, ref_cache
            assert torch.equal(c.valid, r.valid) and torch.equal(c.k, r.k) and torch.equal(c.v, r.v)
    finally:
        torch.set_num_threads(threads)
    assert model.stats.ttft_s > 0 and model.stats.tpot_s > 0 and model.stats.decode.steps == n - 1 \
        and model.stats.decode.tokens == n - 1


def test_eos_inside_a_chunk_and_short_calls(models, chunks, monkeypatch):
    model, ids = models["embedded"], _ids(5)
    ref = _run(model, ids, False, monkeypatch, 12)[0, ids.shape[1]:].tolist()
    # an EOS id first produced at new token ``at`` >= 5 (inside the chunk of 11 decode steps, and inside a streamed
    # chunk of 4 past the first): the same tokens, the cache left as the per-token path leaves it
    at = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    assert at < len(ref) - 1 and at % native_decode.STREAM_CHUNK
    ref_cache: list = []
    _run(model, ids, False, monkeypatch, 12, ref_cache, eos_token_id=ref[at])
    for streamer in (None, Streamer()):
        chunks.clear()
        cache: list = []
        out = _run(model, ids, True, monkeypatch, 12, cache, eos_token_id=ref[at], streamer=streamer)
        assert out[0, ids.shape[1]:].tolist() == ref[:at + 1]
        (c,), (r,) = cache, ref_cache
        assert torch.equal(c.valid, r.valid) and torch.equal(c.k, r.k) and torch.equal(c.v, r.v)
        assert len(chunks) == (1 if streamer is None else -(-at // native_decode.STREAM_CHUNK))
        assert chunks[-1][0][-1] == ref[at]
    # a left-padded prompt of one row: rotary positions behind the cache positions, the padding never valid
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    chunks.clear()
    assert torch.equal(_run(model, ids, True, monkeypatch, 6, attention_mask=mask),
                       _run(model, ids, False, monkeypatch, 6, attention_mask=mask)) and len(chunks) == 1
    # chunks of at most MAX_CHUNK tokens without a streamer: 11 decode steps in chunks of 4, 4, 3
    monkeypatch.setattr(native_decode, "MAX_CHUNK", 4)
    chunks.clear()
    assert _run(model, ids, True, monkeypatch, 12)[0, ids.shape[1]:].tolist() == ref
    assert [len(t) for t, _ in chunks] == [4, 4, 3]
    for n, calls in ((1, 0), (2, 1)):
        chunks.clear()
        assert _run(model, ids, True, monkeypatch, n)[0, ids.shape[1]:].tolist() == ref[:n]
        assert len(chunks) == calls
    assert model.stats.tpot_s is not None  # (the second token: one decode step)


def test_a_streamer_receives_the_same_tokens_across_chunks(models, chunks, monkeypatch):
    model, ids, n = models["qwen3_moe"], _ids(6), 2 * native_decode.STREAM_CHUNK + 2
    ref_stream, stream = Streamer(), Streamer()
    ref = _run(model, ids, False, monkeypatch, n, streamer=ref_stream)
    out = _run(model, ids, True, monkeypatch, n, streamer=stream)
    assert torch.equal(out, ref) and stream.puts == ref_stream.puts and stream.ended
    assert [len(t) for t, _ in chunks] == [4, 4, 1]  # n - 1 decode steps, STREAM_CHUNK per call
    assert model.stats.ttft_s > 0 and model.stats.tpot_s > 0 and model.stats.decode.steps == n - 1 \
        and model.stats.decode.tokens == n - 1


def test_where_the_native_loop_steps_aside(models, chunks, monkeypatch):
    model, ids = models["embedded"], _ids(7)
    refused = [dict(do_sample=True, seed=3, top_k=None), dict(repetition_penalty=1.3)]
    for kw in refused:
        ref = _run(model, ids, False, monkeypatch, 6, **kw)
        assert torch.equal(_run(model, ids, True, monkeypatch, 6, **kw), ref) and not chunks, kw
    two = _ids(8, batch=2)
    assert torch.equal(_run(model, two, True, monkeypatch, 4), _run(model, two, False, monkeypatch, 4))
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, o: None)
    try:
        assert torch.equal(_run(model, ids, True, monkeypatch, 4), _run(model, ids, False, monkeypatch, 4))
    finally:
        handle.remove()
    assert not chunks
    # the one-call step switched off: the plain loop
    model.model.layers_step.enabled = False
    try:
        _run(model, ids, True, monkeypatch, 4)
    finally:
        model.model.layers_step.enabled = True
    assert not chunks
    _run(model, ids, True, monkeypatch, 4)
    assert len(chunks) == 1


def test_an_offloading_policy_runs_the_plain_loop(chunks, monkeypatch):
    model = MoEModel.from_pretrained(embedded_model_path(), device="cpu", attention_bits=4,
                                     offload=OffloadConfig(policy="lru"))
    try:
        ids = _ids(9)
        ref = _run(model, ids, False, monkeypatch, 4)
        assert torch.equal(_run(model, ids, True, monkeypatch, 4), ref) and not chunks
    finally:
        model.close()


def test_ties_and_nan_logits_pick_numpys_index(models, chunks, monkeypatch):
    """An lm_head whose second half repeats its first (every logit tied with its twin V/2 later: the first wins),
    then one with a NaN row (a NaN logit every step: the first NaN wins), as numpy's argmax in the per-token path."""
    from moeflow.kernels.cpu.quant_linear import quantize_linear_cpu

    model, ids = models["embedded"], _ids(10)
    dec = model.model
    head = dec.lm_head
    w = head.dequantized()
    half = w.shape[0] // 2
    try:
        twins = w.clone()
        twins[half:2 * half] = twins[:half]
        for weight in (twins, w):
            dec.lm_head = quantize_linear_cpu(weight, bits=8)
            if weight is w:  # row 7's scale NaN: its logit NaN
                dec.lm_head.int8_scales.view(-1)[7] = float("nan")
            chunks.clear()
            ref = _run(model, ids, False, monkeypatch, 6)
            out = _run(model, ids, True, monkeypatch, 6)
            assert torch.equal(out, ref) and len(chunks) == 1
            logits = chunks[0][1]
            if weight is twins:
                assert torch.equal(logits[:, :half], logits[:, half:2 * half])  # the ties are there
                assert all(t < half for t in chunks[0][0])
            else:
                assert bool(logits[:, 7].isnan().all()) and chunks[0][0] == [7] * 5
    finally:
        dec.lm_head = head


def test_gguf_experts_head_and_stored_embeddings(tmp_path, chunks, steps, monkeypatch):
    """A Mixtral-layout GGUF file (Q4_K gate/up, Q6_K / Q4_K down by layer, a Q6_K lm_head on its blocks, Q8_0
    attention) on ``device="cpu"``: copied (an fp32 ``nn.Embedding``) and mapped with a Q4_K embedding used as stored
    (``mmap=True``: its rows dequantized per lookup, gguf.c's call in the loop too), the native loop runs the GGUF
    experts and head, each step's logits the per-token step's; mapped with a Q8_0 embedding (a lookup in Python's
    dequantizer) the plain loop runs, the same tokens."""
    pytest.importorskip("gguf")
    from gguf_models import T, k_mix_experts, random_k_experts, write_gguf
    from helpers import make_tiny_model

    from moeflow.engine.stored_embedding import StoredEmbedding

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    h = i = 256
    model = make_tiny_model(seed=5, hidden_size=h, intermediate_size=i, num_hidden_layers=2, num_local_experts=4,
                            num_experts_per_tok=2)
    raw = k_mix_experts([("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")], 4, h, i)
    vocab = model.config.vocab_size
    head = random_k_experts("Q6_K", 1, vocab, 9, h)[0]
    for embedding in ("Q8_0", "Q4_K"):
        path = tmp_path / f"{embedding}.gguf"
        tensors = {"output.weight": (head, T.Q6_K)}
        if embedding == "Q4_K":
            tensors["token_embd.weight"] = (random_k_experts("Q4_K", 1, vocab, 10, h)[0], T.Q4_K)
        write_gguf(model, path, expert_types=T.Q8_0, other_type=T.Q8_0, raw_experts=raw, raw_tensors=tensors)
        ids, n = _ids(11), 6
        for mmap in (False, True):
            m = MoEModel.from_pretrained(path, dtype=torch.float32, device="cpu", mmap=mmap)
            try:
                embed = m.model.embed_tokens
                assert isinstance(embed, StoredEmbedding) == mmap
                taken = not mmap or embed.native
                assert taken == (not mmap or embedding == "Q4_K")
                chunks.clear()
                steps.clear()
                ref = _run(m, ids, False, monkeypatch, n)
                ref_logits = list(steps)
                assert len(ref_logits) == n - 1
                assert torch.equal(_run(m, ids, True, monkeypatch, n), ref)
                assert len(chunks) == int(taken)
                if taken:
                    assert all(torch.equal(a, b) for a, b in zip(chunks[0][1], ref_logits, strict=True))
            finally:
                m.close()
