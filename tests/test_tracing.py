"""Routing traces: shapes, dtypes, metadata, agreement with transformers, file checks, splits, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import make_tiny_checkpoint

from moeflow import MoEOffloadedMixtral
from moeflow.errors import MoeflowError
from moeflow.tools.record import TraceRecorder, read_prompts, record_trace
from moeflow.trace import Trace, TraceError, split_sequence_ids

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 40]]
NEW = 4
L, E, K, H = 3, 6, 2, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=3, num_hidden_layers=L)


@pytest.fixture(scope="module")
def model(ckpt):
    return MoEOffloadedMixtral.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def trace(model):
    return record_trace(model, PROMPTS, max_new_tokens=NEW, hidden=True)


def test_shapes_dtypes_and_metadata(trace, model, tmp_path):
    n = sum(len(p) + NEW - 1 for p in PROMPTS)  # the last generated token is never fed back
    assert len(trace) == n
    assert trace.topk_ids.shape == (n, L, K) and trace.topk_ids.dtype == torch.int32
    assert trace.probs.shape == (n, L, E) and trace.probs.dtype == torch.float16
    assert trace.hidden.shape == (n, L, H) and trace.hidden.dtype == torch.float16
    assert trace.embed.shape == (n, H)
    for name, dtype in (("token_ids", torch.int32), ("seq_id", torch.int32), ("pos", torch.int32),
                        ("phase", torch.int8)):
        t = getattr(trace, name)
        assert t.shape == (n,) and t.dtype == dtype, name
    path = trace.save(tmp_path / "t.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["num_layers"] == str(L) and meta["num_experts"] == str(E) and meta["top_k"] == str(K)
    assert meta["model"] == model.name_or_path and meta["hidden_size"] == str(H)
    back = Trace.load(path)
    for name, t in trace.tensors().items():
        assert torch.equal(getattr(back, name), t), name
    assert (back.num_layers, back.num_experts, back.top_k, back.hidden_size) == (L, E, K, H)


def test_rows_follow_prefill_then_greedy_decode(trace, model):
    for seq, prompt in enumerate(PROMPTS):
        rows = trace.seq_id == seq
        assert trace.pos[rows].tolist() == list(range(len(prompt) + NEW - 1))
        assert trace.phase[rows].tolist() == [0] * len(prompt) + [1] * (NEW - 1)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0]
        assert trace.token_ids[rows].tolist() == out[: len(prompt) + NEW - 1].tolist()


def test_routing_matches_transformers(ckpt, trace):
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(ckpt).eval()
    rows = trace.seq_id == 0
    ids = trace.token_ids[rows].long()[None]
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    for layer in range(L):
        probs = torch.softmax(out.router_logits[layer].float(), -1)
        torch.testing.assert_close(trace.probs[rows, layer].float(), probs, atol=2e-3, rtol=0)
        assert torch.equal(trace.topk_ids[rows, layer].long(), torch.topk(probs, K).indices)


def test_hidden_is_the_router_input(trace, model):
    for layer in range(L):
        gate = model.model.layers[layer].block_sparse_moe.gate
        probs = torch.softmax(gate(trace.hidden[:, layer].float()), -1)
        torch.testing.assert_close(probs, trace.probs[:, layer].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(model.model.embed_tokens(trace.token_ids.long()).half(), trace.embed)


def test_speculative_router_calls_are_not_recorded(model):
    with TraceRecorder(model) as rec:
        model(torch.tensor([[1, 2, 3]]))
        gate = model.model.layers[1].block_sparse_moe.gate
        gate(torch.zeros(2, H))  # a prefetcher applying a router to some hidden state
    assert len(rec.steps) == 1 and all(rec.steps[0]["topk"][layer].shape == (3, K) for layer in range(L))


def test_without_hidden(model):
    t = record_trace(model, [[5, 6]], max_new_tokens=2)
    assert t.hidden is None and t.embed is None and len(t) == 3


@pytest.mark.parametrize("name", ["topk_ids", "probs", "token_ids", "seq_id", "pos", "phase"])
def test_missing_tensor_is_named(trace, tmp_path, name):
    from safetensors.torch import save_file

    tensors = {k: v for k, v in trace.tensors().items() if k != name}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"num_layers": str(L), "num_experts": str(E),
                                                                  "top_k": str(K)})
    with pytest.raises(TraceError, match=f"'{name}' is missing"):
        Trace.load(tmp_path / "t.safetensors")


@pytest.mark.parametrize("name,bad", [
    ("probs", lambda t: t.probs[:, :, :-1]),
    ("topk_ids", lambda t: t.topk_ids[:, :-1]),
    ("pos", lambda t: t.pos[:-1]),
    ("hidden", lambda t: t.hidden[:, :, :-1]),
    ("phase", lambda t: t.phase.to(torch.int32)),
])
def test_misshaped_tensor_is_named(trace, tmp_path, name, bad):
    from safetensors.torch import save_file

    tensors = trace.tensors()
    tensors[name] = bad(trace).contiguous()
    meta = {"num_layers": str(L), "num_experts": str(E), "top_k": str(K), "hidden_size": str(H)}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata=meta)
    with pytest.raises(TraceError, match=f"'{name}'") as info:
        Trace.load(tmp_path / "t.safetensors")
    assert isinstance(info.value, MoeflowError)


def test_bad_files_and_values(trace, tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        Trace.load(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a trace")
    with pytest.raises(TraceError, match="cannot read"):
        Trace.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file(trace.tensors(), str(tmp_path / "nometa.safetensors"), metadata={"num_layers": str(L)})
    with pytest.raises(TraceError, match="'num_experts' is missing"):
        Trace.load(tmp_path / "nometa.safetensors")
    bad = trace.topk_ids.clone()
    bad[0, 0, 0] = E
    with pytest.raises(TraceError, match="expert id 6"):
        Trace(bad, trace.probs, trace.token_ids, trace.seq_id, trace.pos, trace.phase, L, E, K)


def test_split_by_sequence():
    train, held = split_sequence_ids(range(20), 0.1, seed=0)
    assert len(held) == 2 and not set(train) & set(held) and sorted(train + held) == list(range(20))
    assert split_sequence_ids(range(20), 0.1, seed=0) == (train, held)
    assert split_sequence_ids(range(20), 0.1, seed=1) != (train, held)
    two = split_sequence_ids([4, 9], 0.1)
    assert len(two[0]) == 1 and len(two[1]) == 1
    assert split_sequence_ids([4], 0.1) == ([4], [])
    with pytest.raises(ValueError):
        split_sequence_ids(range(3), 1.0)


def test_trace_split_keeps_whole_sequences(trace):
    tr, held = trace.split(0.5, seed=0)
    assert len(tr) + len(held) == len(trace)
    assert not set(tr.seq_id.tolist()) & set(held.seq_id.tolist())
    both = Trace.concat([tr, held])
    assert len(both) == len(trace) and len(both.sequence_ids()) == 2


def test_read_prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [1, 2]}\n\n{"prompt": "abc"}\n')
    with pytest.raises(TraceError, match=r"p.jsonl:3: a text prompt needs"):
        read_prompts(p)

    class Tok:
        def encode(self, text):
            return [ord(c) % 50 for c in text]

    assert read_prompts(p, Tok()) == [[1, 2], [47, 48, 49]]
    p.write_text('{"input_ids": [1, -2]}\n')
    with pytest.raises(TraceError, match="p.jsonl:1"):
        read_prompts(p)
    p.write_text('{"input_ids": [1]\n')
    with pytest.raises(TraceError, match="not valid JSON"):
        read_prompts(p)
    p.write_text('{"text": "x"}\n')
    with pytest.raises(TraceError, match="'prompt' or 'input_ids'"):
        read_prompts(p)


def test_trace_command(ckpt, tmp_path, capsys):
    from moeflow.cli.predictors import register

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": p}) for p in PROMPTS) + "\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "t.safetensors"
    args = parser.parse_args(["trace", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                              "--max-new-tokens", "3", "--hidden", "--quiet"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    t = Trace.load(out)
    assert summary["tokens"] == len(t) == sum(len(p) + 2 for p in PROMPTS)
    assert t.hidden is not None and t.metadata["max_new_tokens"] == "3"
