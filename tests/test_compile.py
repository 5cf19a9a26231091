"""compile=True on 32-layer models (issue 14 item 6): the graph breaks only at the offload backend's boundary
(``OffloadedExperts.forward``, compiler-disabled), the decoder layers share their graphs instead of compiling
one per layer, every layer runs compiled (none left eager by dynamo's recompile limit), a further 32 decode
steps compile nothing new, and the tokens are the eager model's."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from family_models import make_family_checkpoint
from helpers import make_tiny_checkpoint
from torch._dynamo.utils import counters

from moeflow import MoEModel, OffloadConfig

LAYERS = 32


class CountingCompiler:
    """A dynamo backend that runs each graph as traced (no code generation) and counts its runs: which graphs
    hold an attention, and how often they ran, shows whether every layer went through a compiled graph."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.runs: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        n = len(self.graphs)
        self.graphs.append(gm)
        self.runs.append(0)

        def run(*args):
            self.runs[n] += 1
            return gm.forward(*args)
        return run

    def attention_runs(self) -> int:
        """Runs of the graphs that call scaled_dot_product_attention (one per layer per step when all compiled)."""
        return sum(runs for gm, runs in zip(self.graphs, self.runs, strict=True)
                   if any("scaled_dot_product_attention" in str(node.target) for node in gm.graph.nodes))


def checkpoint(tmp_path, family: str, layers: int = LAYERS):
    if family == "mixtral":
        return make_tiny_checkpoint(tmp_path, num_hidden_layers=layers)
    return make_family_checkpoint(tmp_path, family, num_hidden_layers=layers)


def compiled_run(path, offload: OffloadConfig | None, steps: int):
    """(eager tokens, compiled tokens of a first and a second generate, the compiler, graph-break reasons,
    unique graphs after the first generate) for ``steps`` decode steps of a batch of two prompts."""
    ids = torch.tensor([[1, 5, 7, 9], [3, 2, 8, 4]])
    model = MoEModel.from_pretrained(path, kernels="torch", offload=offload)
    compiler = CountingCompiler()
    try:
        want = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, eos_token_id=[])
        model.compile_decode(backend=compiler)
        torch._dynamo.reset()
        counters.clear()
        first = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, eos_token_id=[])
        breaks, graphs = list(counters["graph_break"]), counters["stats"]["unique_graphs"]
        before = compiler.attention_runs()
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model.generate(ids, max_new_tokens=steps + 1, do_sample=False, eos_token_id=[])
        attention_runs = compiler.attention_runs() - before
    finally:
        model.close()
        torch._dynamo.reset()
    return want, first, again, breaks, graphs, attention_runs


@pytest.mark.parametrize(("family", "steps"), [("mixtral", 32), ("qwen3_moe", 8)])
def test_offloaded_decode_compiles_once_for_every_layer(tmp_path, family, steps):
    want, first, again, breaks, graphs, attention_runs = compiled_run(
        checkpoint(tmp_path, family), OffloadConfig(policy="lru", gpu_expert_slots=64), steps)
    assert breaks and all("OffloadedExperts.forward" in reason for reason in breaks), breaks
    # per layer would be >= 2 * 32 (the pieces before and after the break); shared: a handful, whatever the depth
    assert graphs <= 12, f"{graphs} graphs for {LAYERS} layers: the layers do not share their graphs"
    assert attention_runs == LAYERS * steps, "some layers ran eagerly (dynamo gave up on their frame)"
    assert torch.equal(first, want) and torch.equal(again, want)


def test_resident_decode_is_one_graph(tmp_path):
    """Every expert resident: the whole step, all layers, is one graph (8 layers: dynamo's trace of one frame
    grows with the depth, and nothing here is per layer)."""
    want, first, again, breaks, graphs, attention_runs = compiled_run(checkpoint(tmp_path, "mixtral", 8), None, 8)
    assert not breaks and graphs == 1
    assert attention_runs == 8  # the one graph holds every layer's attention, once per step
    assert torch.equal(first, want) and torch.equal(again, want)
