"""The moeflow command line, run as a user would (in-process through main())."""

from __future__ import annotations

import pytest
from helpers import make_tiny_checkpoint
from safetensors.torch import load_file

from moeflow.cli import build_parser, main


def test_every_documented_command_is_there():
    parser = build_parser()
    names = set(parser._subparsers._group_actions[0].choices)
    assert {"demo", "generate", "quantize", "trace", "train-predictor", "eval-predictor",
            "simulate", "bench", "serve", "chat"} <= names
    # --help's description names every subcommand (read from the parser, so a new one cannot be left out)
    listed = parser.description.split("Commands: ")[1].rstrip(".").split(", ")
    assert sorted(listed) == sorted(names)


def test_demo_refuses_zero_slots_as_it_refuses_negative_ones(capsys):
    """--slots 0 is a bad value, not "the default" (``args.slots or ...`` took it for one and ran 16 slots)."""
    for slots in ("0", "-3"):
        assert main(["demo", "--device", "cpu", "--slots", slots, "--max-new-tokens", "1"]) == 2
        assert f"gpu_expert_slots must be >= 1, got {slots}" in capsys.readouterr().err


def test_quantize_command(tmp_path, capsys):
    src = make_tiny_checkpoint(tmp_path / "fp32")
    assert main(["quantize", str(src), str(tmp_path / "awq"), "--group-size", "32"]) == 0
    assert "wrote AWQ 4-bit checkpoint" in capsys.readouterr().out
    assert "model.layers.0.block_sparse_moe.experts.0.w2.qweight" in load_file(tmp_path / "awq" / "model.safetensors")
    # a second run refuses to overwrite, with a clear message and a non-zero exit
    assert main(["quantize", str(src), str(tmp_path / "awq"), "--group-size", "32"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_quantize_writes_every_file_with_the_umask_s_mode(tmp_path):
    """safetensors' save_file makes private files (0600) and copy2 copies a source's mode: a model directory
    shared with a server user must be readable, every file 0666 less the umask (0644 under umask 022)."""
    import os
    import stat

    src = make_tiny_checkpoint(tmp_path / "fp32")
    (src / "tokenizer_config.json").write_text("{}")
    os.chmod(src / "tokenizer_config.json", 0o600)  # a copied file takes the umask's mode, not the source's
    old = os.umask(0o022)
    try:
        assert main(["quantize", str(src), str(tmp_path / "awq"), "--group-size", "32"]) == 0
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "awq").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= modes.keys()
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE((tmp_path / "awq").stat().st_mode) == 0o755


def test_generate_without_tokenizer_says_so(tmp_path, capsys):
    src = make_tiny_checkpoint(tmp_path / "fp32")
    assert main(["generate", "--model", str(src), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_group_size_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        main(["quantize", "a", "b", "--group-size", "48"])


@pytest.mark.parametrize("command", [["generate", "--model", "unused"], ["demo"], ["chat"]])
def test_cuda_graphs_flag_reaches_from_pretrained(command, capsys):
    """--cuda-graphs auto (default) / on / off is from_pretrained's None / True / False: "on" with a CPU device is
    the clear error from_pretrained gives before loading anything."""
    args = build_parser().parse_args([*command, "--device", "cpu"])
    assert args.cuda_graphs == "auto"
    assert main([*command, "--device", "cpu", "--cuda-graphs", "on"]) == 2
    assert "cuda_graphs=True needs device='cuda'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--model", "unused"], ["demo"], ["chat"], ["serve"]])
def test_early_hits_flag_reaches_the_offload_config(command, monkeypatch):
    """--early-hits auto (default) / on / off is OffloadConfig(early_hits=None / True / False)."""
    import moeflow

    seen = []

    def fake_from_pretrained(*args, offload=None, **kwargs):
        seen.append(None if offload is None else offload.early_hits)  # None: from_pretrained's own placement
        raise SystemExit(0)  # stop before any loading

    monkeypatch.setattr(moeflow.MoEModel, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(moeflow.MoEOffloadedMixtral, "from_pretrained", fake_from_pretrained)
    for flag, want in (([], None), (["--early-hits", "on"], True), (["--early-hits", "off"], False)):
        with pytest.raises(SystemExit):
            main([*command, "--device", "cpu", *flag])
        assert seen[-1] is want, (command, flag)


def test_offload_flags_or_from_pretrained_s_own_placement():
    """No --policy, budget or offload flag: None (from_pretrained keeps every expert on the device when they fit,
    else offloads with "auto"); a budget without --policy means "auto"; --policy is taken as given."""
    from moeflow import OffloadConfig
    from moeflow.cli.commands import offload_from_args

    def parsed(*flags):
        return build_parser().parse_args(["generate", "--model", "m", *flags])

    assert offload_from_args(parsed(), None, None) is None
    args = parsed("--gpu-memory-gb", "12")
    assert offload_from_args(args, None, args.policy) == OffloadConfig(policy="auto", gpu_memory_gb=12.0)
    assert offload_from_args(parsed("--slots", "8"), 8, None) == OffloadConfig(policy="auto", gpu_expert_slots=8)
    args = parsed("--early-hits", "off")
    assert offload_from_args(args, None, args.policy) == OffloadConfig(early_hits=False)
    args = parsed("--policy", "lru", "--slots", "8")
    assert offload_from_args(args, 8, args.policy) == OffloadConfig(policy="lru", gpu_expert_slots=8)


@pytest.mark.parametrize("command", [["generate", "--model", "unused"], ["demo"], ["chat"], ["serve"],
                                     ["generate", "--model", "unused", "--chat"],
                                     ["trace", "--model", "unused", "--prompts", "p.jsonl", "--out", "t.safetensors"]])
def test_loading_flags_reach_from_pretrained(command, monkeypatch):
    """--no-mmap / --cpu-form-cache are from_pretrained's mmap=False / cpu_form_cache=True; without them its
    defaults (mmap=True, cpu_form_cache=False), on every command that loads a model."""
    import moeflow

    seen = []

    def fake_from_pretrained(*args, **kwargs):
        seen.append((kwargs["mmap"], kwargs["cpu_form_cache"]))
        raise SystemExit(0)  # stop before any loading

    monkeypatch.setattr(moeflow.MoEModel, "from_pretrained", fake_from_pretrained)
    for flags, want in (([], (True, False)), (["--no-mmap"], (False, False)), (["--cpu-form-cache"], (True, True)),
                        (["--no-mmap", "--cpu-form-cache"], (False, True))):
        with pytest.raises(SystemExit):
            main([*command, "--device", "cpu", *flags])
        assert seen[-1] == want, (command, flags)
    assert len(seen) == 4


def test_serve_help_lists_the_loading_flags(capsys):
    """``moeflow serve --help`` shows both, with where the CPU form cache goes and what it costs on disk."""
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal's width
    assert "--no-mmap" in text and "--cpu-form-cache" in text
    assert "cpu_forms" in text and "disk space equal to the experts' converted size" in text
