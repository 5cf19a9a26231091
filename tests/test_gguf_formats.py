"""GGUF expert formats: the ggml block table and exact dequantization (against gguf-py's own ``dequantize`` and
hand-made blocks), the region layout round trip, errors, and the torch path against an outside oracle."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_block_helpers import random_blocks, random_gguf_expert

from moeflow import kernels
from moeflow.kernels.experts.gguf_reference import GGML_TYPES, dequantize
from moeflow.kernels.formats import ALIGN, FORMATS, GGUFFormat, expert_format, gguf_expert_format
from moeflow.kernels.pool import ExpertPool

TYPES = tuple(GGML_TYPES)


@pytest.mark.parametrize("name", TYPES)
def test_block_table_is_ggmls(name):
    t = GGML_TYPES[name]
    qtype = gguf.GGMLQuantizationType[name]
    assert t.type_id == int(qtype)
    assert gguf.GGML_QUANT_SIZES[qtype] == (t.block_size, t.type_size)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_gguf_pys_bit_for_bit(name, rows):
    gen = torch.Generator().manual_seed(rows)
    k = 3 * GGML_TYPES[name].block_size
    data = random_blocks(name, rows, k, gen)
    expected = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[name])
    got = dequantize(data, name).numpy()
    assert got.shape == (rows, k) == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def _f16_bytes(v: float) -> list[int]:
    return list(torch.tensor([v], dtype=torch.float16).view(torch.uint8).tolist())


def test_hand_made_q8_0_and_q4_0_blocks():
    q8 = torch.tensor(_f16_bytes(0.5) + [b & 0xFF for b in range(-16, 16)], dtype=torch.uint8).view(1, -1)
    assert dequantize(q8, "Q8_0").tolist() == [[0.5 * v for v in range(-16, 16)]]
    # qs[j] = j | (15 - j) << 4: element j is j - 8, element j + 16 is 7 - j
    q4 = torch.tensor(_f16_bytes(2.0) + [j | (15 - j) << 4 for j in range(16)], dtype=torch.uint8).view(1, -1)
    assert dequantize(q4, "Q4_0").tolist() == [[2.0 * (j - 8) for j in range(16)] + [2.0 * (7 - j) for j in range(16)]]


def test_hand_made_q4_k_block():
    """Scales / mins with high bits (j >= 4 use the packed 12-byte form) and element p = 64 c + 32 h + l holding
    nibble (l + h) % 16: checks llama.cpp's bit layout independently of the dequantizer's code."""
    sc = [1, 20, 33, 63, 40, 17, 62, 5]
    mn = [7, 63, 0, 31, 50, 2, 33, 60]
    s = [0] * 12
    for j in range(4):
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6
        s[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6
        s[j + 8] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4
    qs = [(l % 16) | ((l + 1) % 16) << 4 for _ in range(4) for l in range(32)]  # noqa: E741
    block = torch.tensor(_f16_bytes(0.25) + _f16_bytes(0.125) + s + qs, dtype=torch.uint8).view(1, -1)
    got = dequantize(block, "Q4_K")[0].tolist()
    for p in range(256):
        j, l = p // 32, p % 32  # noqa: E741
        q = (l + j % 2) % 16
        assert got[p] == 0.25 * sc[j] * q - 0.125 * mn[j], p


def test_hand_made_q6_k_block():
    """Element p = 128 n + 32 g + l: 6-bit q from ql / qh as ggml lays them out, scale p // 16 (signed)."""
    want_q = [(p * 7 + 3) % 64 for p in range(256)]
    ql, qh = [0] * 128, [0] * 64
    for p, q in enumerate(want_q):
        n, g, l = p // 128, (p % 128) // 32, p % 32  # noqa: E741
        ql[64 * n + 32 * (g % 2) + l] |= (q & 15) << (4 * (g // 2))
        qh[32 * n + l] |= (q >> 4) << (2 * g)
    scales = [(-1) ** i * (i * 9 % 128) for i in range(16)]
    block = torch.tensor(ql + qh + [v & 0xFF for v in scales] + _f16_bytes(0.5), dtype=torch.uint8).view(1, -1)
    got = dequantize(block, "Q6_K")[0].tolist()
    assert got == [0.5 * scales[p // 16] * (want_q[p] - 32) for p in range(256)]


def test_types_by_name_id_and_enum():
    fmt = gguf_expert_format("q4_k", gguf.GGMLQuantizationType.Q6_K, 256, 512, torch.bfloat16)
    assert isinstance(fmt, GGUFFormat) and (fmt.gate_up_types, fmt.down_types) == (("Q4_K",), ("Q6_K",))
    assert gguf_expert_format(12, ["Q6_K"], 256, 512, torch.bfloat16) is fmt
    mixed = gguf_expert_format("Q4_K", ("Q6_K", "q4_k", 12), 256, 512, torch.bfloat16)
    assert mixed.down_types == ("Q4_K", "Q6_K") and mixed != fmt
    assert FORMATS[("gguf", False)] is GGUFFormat
    with pytest.raises(ValueError, match=r"unsupported GGUF expert weight type 'IQ2_XS'.*Q4_0 \(id 2\).*Q6_K"):
        gguf_expert_format("IQ2_XS", "Q6_K", 256, 256, torch.float32)
    with pytest.raises(ValueError, match=r"unsupported GGUF expert weight type 10\b"):  # Q2_K
        gguf_expert_format(10, "Q6_K", 256, 256, torch.float32)
    with pytest.raises(ValueError, match="down experts in Q6_K need their input size \\(96\\) to be a multiple of 256"):
        gguf_expert_format("Q8_0", "Q6_K", 256, 96, torch.float32)
    with pytest.raises(ValueError, match="needs 1 or 2 gate/up block types.*gguf_expert_format"):
        expert_format(256, 256, "gguf", torch.float32)
    with pytest.raises(ValueError, match="needs 1 or 2 down block types"):
        gguf_expert_format("Q4_K", ["Q4_K", "Q5_K", "Q6_K"], 256, 256, torch.float32)
    with pytest.raises(ValueError, match=r"block types \('Q4_0', 'Q4_K'\) have rows of the same size"):
        gguf_expert_format("Q8_0", ["Q4_0", "Q4_K"], 256, 256, torch.float32)


def test_layout_round_trip_and_errors():
    fmt = gguf_expert_format("Q4_K", "Q6_K", 256, 512, torch.float32)
    assert fmt.loader_shapes() == {"gate": (512, 144), "up": (512, 144), "down": (256, 420)}
    assert [s.offset % ALIGN for s in fmt.specs] == [0, 0, 0, 0] and fmt.nbytes % ALIGN == 0
    assert fmt.nbytes == 2 * 512 * 144 + 256 * 420 + ALIGN  # the file's bytes (whole ALIGN units) + the types
    assert not fmt.fused_moe and not fmt.cpu_int4 and not fmt.w13_halves
    assert fmt.capturable and fmt.capture_unsupported("triton") is None  # tests/test_device_graphs_formats.py
    assert fmt.cpu_unsupported() is None or "do not build" in fmt.cpu_unsupported()  # Q4_K, Q6_K: CPU kernels
    assert "Q4_1 blocks, which have no CPU kernels" in gguf_expert_format("Q4_1", "Q6_K", 256, 512,
                                                                          torch.float32).cpu_unsupported()
    gen = torch.Generator().manual_seed(0)
    experts = [random_gguf_expert(fmt, gen) for _ in range(2)]
    pool = ExpertPool.allocate(fmt, 2, "cpu")
    for slot, t in enumerate(experts):
        fmt.write(pool.buffer[slot], t)
    for slot, t in enumerate(experts):
        back = fmt.loader_tensors(pool.buffer[slot])
        assert back.keys() == t.keys() and all(torch.equal(back[n], t[n]) for n in t)
        w13, b13, w2, b2 = fmt.reference_weights(pool, slot)
        assert b13 is None and b2 is None
        assert torch.equal(w13, torch.cat([dequantize(t["gate"], "Q4_K"), dequantize(t["up"], "Q4_K")]))
        assert torch.equal(w2, dequantize(t["down"], "Q6_K"))
    good = experts[0]
    with pytest.raises(KeyError, match="missing GGUF expert tensor 'down'"):
        fmt.write(pool.buffer[0], {k: v for k, v in good.items() if k != "down"})
    with pytest.raises(ValueError, match="'up' must be the file's bytes \\(uint8\\)"):
        fmt.write(pool.buffer[0], {**good, "up": good["up"].to(torch.int16)})
    with pytest.raises(ValueError, match=r"'down' has shape \(256, 210\), expected \(256, 420\) \(Q6_K\)"):
        fmt.write(pool.buffer[0], {**good, "down": good["down"][:, :210]})


def test_two_down_types_in_one_format():
    """Q4_K_M's layers: down in Q6_K or Q4_K. Rows sized for Q6_K, Q4_K rows padded; each region records its
    types; write / loader_tensors invert each other for both; gate and up must agree."""
    fmt = gguf_expert_format("Q4_K", ("Q4_K", "Q6_K"), 256, 512, torch.float32)
    assert fmt.loader_shapes()["down"] == (256, 420)
    gen = torch.Generator().manual_seed(3)
    experts = [random_gguf_expert(fmt, gen, down=d) for d in ("Q6_K", "Q4_K", "Q4_K")]
    assert experts[1]["down"].shape == (256, 288)
    pool = ExpertPool.allocate(fmt, 3, "cpu")
    pool.buffer.fill_(0xAB)
    for slot, t in enumerate(experts):
        fmt.write(pool.buffer[slot], t)
    for slot, (t, down) in enumerate(zip(experts, ("Q6_K", "Q4_K", "Q4_K"), strict=True)):
        assert [g.name for g in fmt.region_types(pool.buffer[slot])] == ["Q4_K", down]
        back = fmt.loader_tensors(pool.buffer[slot])
        assert all(torch.equal(back[n], t[n]) for n in t)
        assert torch.equal(fmt.reference_weights(pool, slot)[2], dequantize(t["down"], down))
    assert not pool.tensors["down"][1][:, 288:].any()  # padding zeroed
    both = gguf_expert_format(("Q4_K", "Q6_K"), "Q4_K", 256, 512, torch.float32)
    q6_gate = random_gguf_expert(both, gen, gate_up="Q6_K")["gate"]
    with pytest.raises(ValueError, match=r"gate \(Q6_K\) and up \(Q4_K\) must share a block type"):
        both.write(torch.empty(both.nbytes, dtype=torch.uint8), {**random_gguf_expert(both, gen), "gate": q6_gate})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_gguf_py_oracle(dtype):
    """``kernels.expert_forward(backend="torch")`` against a computation from gguf-py's dequantized weights,
    following the reference contract (fp32 GEMMs, silu(gate) * up stored in the activation dtype, w2 times the
    routing weight stored in it)."""
    fmt = gguf_expert_format("Q4_0", "Q8_0", 64, 96, dtype)
    gen = torch.Generator().manual_seed(1)
    E, T, k = 3, 4, 2
    experts = [random_gguf_expert(fmt, gen) for _ in range(E)]
    pool = ExpertPool.allocate(fmt, E, "cpu")
    slot_of_expert = torch.tensor([2, 0, 1], dtype=torch.int32)
    for e, t in enumerate(experts):
        fmt.write(pool.buffer[int(slot_of_expert[e])], t)
    x = torch.randn(T, 64, generator=gen).to(dtype)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]], dtype=torch.int32)
    w = torch.rand(T, k, generator=gen)
    out = kernels.expert_forward(x, ids, w, pool, slot_of_expert, torch.zeros(T * k, 64, dtype=dtype), None, "torch")

    def deq(t, name):
        return torch.from_numpy(gguf.quants.dequantize(t.numpy(), gguf.GGMLQuantizationType[name]).copy())

    for pair in range(T * k):
        tok, e = pair // k, int(ids.view(-1)[pair])
        gate, up, down = deq(experts[e]["gate"], "Q4_0"), deq(experts[e]["up"], "Q4_0"), deq(experts[e]["down"], "Q8_0")
        row = x[tok : tok + 1].float()
        a = (F.silu(row @ gate.T) * (row @ up.T)).to(dtype)
        want = ((a.float() @ down.T) * w.view(-1)[pair]).to(dtype)
        torch.testing.assert_close(out[pair : pair + 1], want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3)


def test_custom_op_and_compile_fullgraph():
    """``GGUFFormat.forward`` runs as ``torch.ops.moeflow.gguf_expert_forward``: opcheck, and a resident MoE forward
    traced whole by ``torch.compile(fullgraph=True)`` giving the eager bits."""
    fmt = gguf_expert_format("Q4_0", ("Q8_0", "Q4_0"), 64, 96, torch.float32)
    gen = torch.Generator().manual_seed(2)
    pool = ExpertPool.allocate(fmt, 3, "cpu")
    for s, down in enumerate(("Q8_0", "Q4_0", "Q8_0")):
        fmt.write(pool.buffer[s], random_gguf_expert(fmt, gen, down=down))
    slots = torch.tensor([1, 2, 0], dtype=torch.int32)
    x = torch.randn(4, 64, generator=gen)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]], dtype=torch.int32)
    w = torch.rand(4, 2, generator=gen)
    out = torch.zeros(8, 64)
    torch.library.opcheck(torch.ops.moeflow.gguf_expert_forward.default,
                          (x, ids, w, pool.buffer, slots, None, 64, 96, "Q4_0", "Q4_0+Q8_0", torch.float32, [],
                           "torch", out))
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, ids, w):
        return kernels.moe_forward(x, ids, w, pool, slots, "torch")

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    assert torch.equal(compiled(x, ids, w), f(x, ids, w))
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("moeflow.gguf_expert_forward" in o for o in ops), ops


def test_ggml_mxfp4_rows_convert_to_the_mxfp4_format():
    """gpt-oss GGUF's MXFP4 blocks (ggml type 39) -> the published blocks / scales the MXFP4 format runs: the same
    values as gguf-py's dequantize (odd row count, every code, exponents around 127)."""
    from moeflow.kernels.experts.mxfp4_reference import dequantize_mxfp4, from_ggml_mxfp4

    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (3, 4, 17), generator=gen, dtype=torch.uint8)
    raw[..., 0] = torch.randint(110, 140, (3, 4), generator=gen, dtype=torch.uint8)
    raw = raw.reshape(3, -1)
    blocks, scales = from_ggml_mxfp4(raw)
    assert blocks.shape == (3, 4, 16) and scales.shape == (3, 4)
    expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(dequantize_mxfp4(blocks, scales).numpy(), expected)  # values (ggml's +0 is e2m1's -0)
    with pytest.raises(ValueError, match="GGUF MXFP4 rows must be uint8"):
        from_ggml_mxfp4(raw[:, :20])
