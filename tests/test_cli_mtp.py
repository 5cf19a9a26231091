"""`moeflow generate / chat / generate --chat --speculative mtp [--num-speculative-tokens K]` (vLLM's flags), run in
process through main() on a tiny DeepSeek-V3 checkpoint with an MTP layer and the embedded model's tokenizer: the
text of plain greedy decoding with drafts counted, K defaulting to 1, and the refusals (K without --speculative,
--speculative with --prompt-lookup, a model without MTP layers: the loader's own message). ~15 s on 2 cores."""

from __future__ import annotations

import json

import pytest
from mtp_helpers import make_mtp_checkpoint, make_mtp_checkpoint_with_tokenizer
from test_mtp import SHAPE

from moeflow.cli import build_parser, main
from moeflow.cli.commands import speculative_from_args

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The import statement"
GEN = ["--device", "cpu", "--greedy", "--max-new-tokens", "12", "--no-warmup", "--prompt", PROMPT]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mtp_checkpoint_with_tokenizer(tmp_path_factory.mktemp("cli_mtp"), **dict(SHAPE))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def answers(lines: list[str]):
    """An ``input()`` stand-in that answers ``lines`` in turn."""
    it = iter(lines)
    return lambda _prompt: next(it)


def stats_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_flags_default_and_refusals():
    def parsed(*flags):
        return speculative_from_args(build_parser().parse_args(["generate", "--model", "m", *flags]))

    assert parsed() is None
    assert parsed("--speculative", "mtp") == 1  # vLLM's default for MTP
    assert parsed("--speculative", "mtp", "--num-speculative-tokens", "3") == 3
    with pytest.raises(ValueError, match="--num-speculative-tokens needs --speculative mtp"):
        parsed("--num-speculative-tokens", "2")
    with pytest.raises(ValueError, match="positive integer, got 0"):
        parsed("--speculative", "mtp", "--num-speculative-tokens", "0")
    with pytest.raises(ValueError, match="two ways to draft"):
        parsed("--speculative", "mtp", "--prompt-lookup", "3")
    with pytest.raises(SystemExit):  # (argparse: only "mtp" is a method)
        parsed("--speculative", "ngram")


@pytest.mark.parametrize("k", [None, "3"], ids=["default-k", "k3"])
def test_generate_speculative_prints_plain_greedy_text(tiny, capsys, k):
    rc, plain, _ = run(capsys, "generate", "--model", str(tiny), *GEN, "--json")
    assert rc == 0
    flags = ["--speculative", "mtp"] + (["--num-speculative-tokens", k] if k else [])
    rc, drafted, _ = run(capsys, "generate", "--model", str(tiny), *GEN, "--json", *flags)
    assert rc == 0
    assert drafted.splitlines()[0] == plain.splitlines()[0]  # the streamed text: prompt and 12 greedy tokens
    stats, base = stats_of(drafted), stats_of(plain)
    assert base["draft_tokens"] == 0 and stats["draft_tokens"] > 0
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["generated_tokens"] == 12
    # K = 1 drafts one token per verify pass, each pass adding 1 + accepted tokens to the first: 11 = passes +
    # accepted, every pass drafting but possibly the last (one token of room left: nothing to draft)
    if k is None:
        assert stats["draft_tokens"] + stats["accepted_tokens"] in (10, 11)
    assert f"drafts {stats['accepted_tokens']}/{stats['draft_tokens']} accepted" in drafted


def test_generate_chat_and_chat_speculative_reply_equals_plain(tiny, capsys, monkeypatch):
    rc, plain, _ = run(capsys, "generate", "--model", str(tiny), *GEN, "--chat")
    rc2, drafted, _ = run(capsys, "generate", "--model", str(tiny), *GEN, "--chat", "--speculative", "mtp",
                          "--num-speculative-tokens", "2")
    assert rc == rc2 == 0
    assert drafted.splitlines()[0] == plain.splitlines()[0]
    assert "drafts " in drafted and "drafts " not in plain
    replies = []
    for flags in ([], ["--speculative", "mtp", "--num-speculative-tokens", "2"]):
        monkeypatch.setattr("builtins.input", answers([PROMPT, ""]))
        rc, out, _ = run(capsys, "chat", "--model", str(tiny), *GEN[:5], *flags)
        assert rc == 0
        replies.append(out.split("assistant> ")[1])
    assert replies[0] == replies[1] and replies[0].strip()


def test_refusals_exit_2_naming_the_flag_or_the_model(tiny, tmp_path, capsys):
    rc, _, err = run(capsys, "generate", "--model", str(tiny), *GEN, "--num-speculative-tokens", "2")
    assert rc == 2 and "--num-speculative-tokens needs --speculative mtp" in err
    rc, _, err = run(capsys, "chat", "--model", str(tiny), "--device", "cpu", "--num-speculative-tokens", "2")
    assert rc == 2 and "--num-speculative-tokens needs --speculative mtp" in err
    rc, _, err = run(capsys, "serve", "--model", str(tiny), "--device", "cpu", "--num-speculative-tokens", "2")
    assert rc == 2 and "--num-speculative-tokens needs --speculative mtp" in err
    rc, _, err = run(capsys, "serve", "--model", str(tiny), "--device", "cpu", "--speculative", "mtp",
                     "--cuda-graphs", "on")
    assert rc == 2 and "--speculative mtp runs the server's passes eagerly" in err
    # a checkpoint without the MTP tensors, and a family without MTP layers: from_pretrained(mtp=True)'s refusal
    bare, _, _ = make_mtp_checkpoint(tmp_path / "bare", seed=5, with_mtp=False, vocab_size=256, **dict(SHAPE))
    rc, _, err = run(capsys, "generate", "--model", str(bare), *GEN, "--speculative", "mtp")
    assert rc == 2 and "multi-token-prediction tensor 'model.layers.3." in err and "num_nextn_predict_layers=1" in err
    rc, _, err = run(capsys, "serve", "--model", str(bare), "--device", "cpu", "--speculative", "mtp")
    assert rc == 2 and "multi-token-prediction tensor 'model.layers.3." in err
    rc, _, err = run(capsys, "demo", *GEN, "--speculative", "mtp")
    assert rc == 2 and "mtp=True but the model has no multi-token-prediction layers" in err
    assert "mixtral family" in err
