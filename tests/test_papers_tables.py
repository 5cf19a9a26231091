"""scripts/papers_tables.py's pieces that depend on the model family (the tables themselves are benchmark runs)."""

from __future__ import annotations

from helpers import make_tiny_checkpoint

from moeflow import MoEModel


def test_routed_experts_reads_the_family_s_count(tmp_path):
    """A Mixtral config names its experts num_local_experts (no num_experts field): the batch8 budgets' total is
    MoE layers x experts from the family, as the engine sizes its slots."""
    from scripts.papers_tables import routed_experts

    model = MoEModel.from_pretrained(make_tiny_checkpoint(tmp_path / "m", num_local_experts=6), device="cpu")
    assert not hasattr(model.config, "num_experts")
    assert routed_experts(model) == model.config.num_hidden_layers * 6
