"""``from_pretrained(<gguf>, mtp=True)``: the multi-token-prediction (nextn) layers llama.cpp's converter keeps in
glm4moe (GLM-4.5) and deepseek2 (GLM-4.7-Flash) files, read and drafted with.

The files are tests/mtp_helpers.py's tiny checkpoints with an MTP layer (transformers' classes, random weights),
written by the tests' GGUF writers as the converter lays them out (the MTP block as ``blk.N``, its own tensors as
``blk.N.nextn.*``, ``nextn_predict_layers`` 1): the f32 files' main and MTP logits equal the safetensors load of the
same checkpoint exactly (same fp32 weights, same code); a Q8_0 file's MTP logits equal the fp32 reference module
on gguf-py's dequantization within 1e-4 (torch kernels); greedy tokens with speculation = plain greedy, resident,
under lru with a random-delay transport (the MTP layer's experts looked up through the backend) and on the CPU GGUF
kernels over the mapped file, and on an all-Q4_0 file (the AWQ format); the serving engine's drafts and
``moeflow generate --speculative mtp`` on the file give plain greedy's tokens / text; without ``mtp`` the file loads
as before; refusals name the file and the key or tensor. tests/test_gguf_mtp_llama_cpp.py does the same on files
made by llama.cpp's converter. ~20 s on 2 cores."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("gguf")

from gguf_deepseek2 import write_deepseek2_gguf  # noqa: E402
from gguf_models import T, reference_model, write_gguf  # noqa: E402
from mtp_helpers import make_mtp_checkpoint, mtp_layer_logits, reference_mtp_logits, routed_layers  # noqa: E402
from test_mtp import SHAPE  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.errors import CheckpointError  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*dequantized into")]

NEW = 10
# GLM-4.5-shaped; one expert group (llama.cpp's glm4moe graph has none, so a GGUF file cannot say groups)
GLM = dict(num_hidden_layers=3, n_routed_experts=6, num_key_value_heads=2, head_dim=32, use_qk_norm=True,
           attention_bias=True, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
           routed_scaling_factor=2.5, partial_rotary_factor=0.5)
IDS = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))


def greedy(model: MoEModel, **kw) -> torch.Tensor:
    return model.generate(IDS, max_new_tokens=NEW, do_sample=False, eos_token_id=[], **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (safetensors directory, f32 GGUF)} for GLM-4.5 (glm4moe) and DeepSeek-V3-shaped (deepseek2, the
    layout of GLM-4.7-Flash's files), and the GLM model / own tensors for the quantized file."""
    root = tmp_path_factory.mktemp("gguf_mtp")
    out = {}
    path, glm, own = make_mtp_checkpoint(root / "glm", seed=3, kind="glm4_moe", **GLM)
    write_gguf(glm, root / "glm.gguf", expert_types=T.F32, other_type=T.F32, nextn=own)
    out["glm4moe"] = (path, root / "glm.gguf")
    written = write_gguf(glm, root / "glm-q8.gguf", expert_types=T.Q8_0, other_type=T.Q8_0, nextn=own)
    out["q8"] = (glm, written, root / "glm-q8.gguf")
    write_gguf(glm, root / "glm-q4.gguf", expert_types=T.Q4_0, other_type=T.Q4_0, nextn=own)
    out["q4"] = root / "glm-q4.gguf"
    path, ds, own = make_mtp_checkpoint(root / "ds", seed=5, **dict(SHAPE))
    write_deepseek2_gguf(copy.deepcopy(ds), root / "ds.gguf", nextn=own)
    out["deepseek2"] = (path, root / "ds.gguf")
    out["glm_own"] = (glm, own, root)
    return out


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_f32_logits_and_tokens_equal_the_safetensors_load(files, arch):
    """The f32 file's main and MTP logits are the safetensors load's (the same fp32 weights through the same code:
    exact); its greedy tokens with speculation (k = 1, 3) equal plain greedy and the safetensors load's."""
    path, gguf_path = files[arch]
    st, gg = MoEModel.from_pretrained(path, mtp=True), MoEModel.from_pretrained(gguf_path, mtp=True)
    assert gg.mtp is not None and len(gg.mtp.layers) == 1
    main_st, mtp_st = mtp_layer_logits(st, IDS)
    main_gg, mtp_gg = mtp_layer_logits(gg, IDS)
    assert torch.equal(main_gg, main_st) and torch.equal(mtp_gg, mtp_st)
    plain = greedy(st)
    assert torch.equal(greedy(gg), plain)
    for k in (1, 3):
        assert torch.equal(greedy(gg, num_speculative_tokens=k), plain), k


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_offloaded_mtp_experts_go_through_the_backend(files, arch):
    """lru over 3 slots, random-delay transport: the MTP layer's experts are MoE layer 2 of the backend (looked up
    in the MTP passes) and the tokens equal plain greedy."""
    path, gguf_path = files[arch]
    plain = greedy(MoEModel.from_pretrained(path))
    model = MoEModel.from_pretrained(gguf_path, mtp=True, offload=OffloadConfig(
        policy="lru", gpu_expert_slots=3, transport="random-delay", random_delay_ms=0.3, seed=3))
    with routed_layers(model) as seen:
        out = greedy(model, num_speculative_tokens=2)
    assert torch.equal(out, plain)
    assert seen.count(2) > 0 and set(seen) == {0, 1, 2}
    assert model.stats.bytes_per_generated_token > 0


def test_q8_0_nextn_tensors_dequantized(files):
    """A Q8_0 file (experts, MTP block and eh_proj Q8_0; norms F32): the MTP logits equal the fp32 reference module
    on gguf-py's dequantization of the file (1e-4; torch kernels), and on the CPU GGUF kernels over the mapped
    file and under lru greedy with speculation is plain greedy."""
    glm, written, gguf_path = files["q8"]
    own = {k.removeprefix("nextn."): torch.from_numpy(v) for k, v in written.items() if k.startswith("nextn.")}
    assert set(own) == {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}
    want = reference_mtp_logits(reference_model(copy.deepcopy(glm), written), own, IDS)
    model = MoEModel.from_pretrained(gguf_path, mtp=True, kernels="torch")
    _, got = mtp_layer_logits(model, IDS)
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)
    for offload in (None, OffloadConfig(policy="lru", gpu_expert_slots=4)):
        model = MoEModel.from_pretrained(gguf_path, mtp=True, offload=offload)
        plain = greedy(model)
        assert torch.equal(greedy(model, num_speculative_tokens=2), plain), offload


def test_q4_0_file_experts_in_the_awq_format(files):
    """An all-Q4_0 file (the MTP layer's experts too): the experts become the AWQ format (CPU int4), resident and
    under lru; greedy with speculation is plain greedy."""
    for offload in (None, OffloadConfig(policy="lru", gpu_expert_slots=4)):
        model = MoEModel.from_pretrained(files["q4"], mtp=True, offload=offload)
        assert model.experts.fmt.cpu_int4
        plain = greedy(model)
        assert torch.equal(greedy(model, num_speculative_tokens=2), plain), offload


def test_without_mtp_the_file_loads_as_before(files):
    """mtp=False (the default) on a file with an MTP layer: the decoder only; speculation refused naming mtp=True;
    prompt lookup drafts."""
    path, gguf_path = files["glm4moe"]
    model = MoEModel.from_pretrained(gguf_path)
    assert model.mtp is None and model.family.num_mtp_layers() == 1
    plain = greedy(model)
    assert torch.equal(plain, greedy(MoEModel.from_pretrained(path)))
    with pytest.raises(ValueError, match=r"mtp=True"):
        greedy(model, num_speculative_tokens=1)
    assert torch.equal(greedy(model, prompt_lookup_num_tokens=2), plain)


def test_refusals_name_the_file_and_the_key_or_tensor(files):
    """A file without nextn layers: refused naming the file and ``glm4moe.nextn_predict_layers`` (prompt lookup
    named as the way to draft); a file that declares one but lacks ``blk.3.nextn.eh_proj``: refused naming the file
    and that tensor."""
    glm, own, root = files["glm_own"]
    plain_glm = copy.deepcopy(glm)
    plain_glm.model.layers = plain_glm.model.layers[:3]
    plain_glm.config.num_hidden_layers = 3
    write_gguf(plain_glm, root / "no-mtp.gguf", expert_types=T.F32, other_type=T.F32)
    with pytest.raises(CheckpointError, match=r"no-mtp\.gguf: mtp=True .*no glm4moe\.nextn_predict_layers.*"
                                              r"prompt_lookup_num_tokens"):
        MoEModel.from_pretrained(root / "no-mtp.gguf", mtp=True)
    write_gguf(glm, root / "no-eh.gguf", expert_types=T.F32, other_type=T.F32,
               nextn={k: v for k, v in own.items() if k != "eh_proj.weight"})
    with pytest.raises(CheckpointError, match=r"no-eh\.gguf: mtp=True .*'blk\.3\.nextn\.eh_proj\.weight'"):
        MoEModel.from_pretrained(root / "no-eh.gguf", mtp=True)
    assert MoEModel.from_pretrained(root / "no-eh.gguf").mtp is None  # (the decoder alone still loads)


def test_cli_generate_speculative_on_the_gguf(files, capsys, monkeypatch, tmp_path):
    """``moeflow generate --model <gguf> --speculative mtp``: the text of plain greedy, drafts counted (the
    tokenizer rebuilt from the file's metadata)."""
    import json

    from moeflow.cli import main

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    _, gguf_path = files["glm4moe"]
    gen = ["generate", "--model", str(gguf_path), "--device", "cpu", "--greedy", "--max-new-tokens", "12",
           "--no-warmup", "--prompt", "abc def", "--json"]
    outs = []
    for flags in ([], ["--speculative", "mtp", "--num-speculative-tokens", "2"]):
        assert main(gen + flags) == 0
        outs.append(capsys.readouterr().out)
    plain, drafted = outs
    assert drafted.splitlines()[0] == plain.splitlines()[0]
    stats = json.loads(drafted.strip().splitlines()[-1])
    assert stats["draft_tokens"] > 0 and stats["generated_tokens"] == 12


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_serving_engine_drafts_on_the_gguf(files, arch):
    """The continuous-batching engine (``moeflow serve --speculative mtp``) on the GGUF with its MTP layer: a greedy
    request alone gets plain greedy's tokens, with drafts."""
    from test_engine_lookup import run

    from moeflow.engine.continuous import SamplingParams

    _, gguf_path = files[arch]
    model = MoEModel.from_pretrained(gguf_path, mtp=True)
    ids = IDS[0].tolist()
    want = greedy(model)[0, len(ids):].tolist()
    (seq,), _, _ = run(model, [(ids, SamplingParams(max_new_tokens=NEW))], lookup=None, num_speculative_tokens=2)
    assert seq.generated == want and seq.draft_tokens > 0
