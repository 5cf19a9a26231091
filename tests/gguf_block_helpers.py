"""Random GGUF expert blocks for the GGUF format and kernel tests (no file needed): random bytes with finite fp16
scale fields, small enough that a layer's outputs stay O(1)."""

from __future__ import annotations

import torch

from moeflow.kernels.experts.gguf_reference import ggml_type
from moeflow.kernels.formats import GGUFFormat

# byte offsets of each block type's fp16 fields (d, and dmin for the K-quants with mins)
FP16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2),
               "Q5_0": (0,), "Q5_1": (0, 2)}
# a scale that keeps each type's dequantized weights around 0.05 (K-quants multiply d by 6-bit / int8 scales)
D_SCALE = {"Q4_0": 0.01, "Q8_0": 0.001, "Q4_K": 0.0002, "Q5_K": 0.0001, "Q6_K": 0.0002, "Q4_1": 0.01,
           "Q5_0": 0.005, "Q5_1": 0.005}


def random_blocks(type_name: str, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, k / QK * type_size]: random bytes, each fp16 field a finite random value."""
    t = ggml_type(type_name)
    blocks = torch.randint(0, 256, (rows, k // t.block_size, t.type_size), generator=gen, dtype=torch.uint8)
    for off in FP16_FIELDS[t.name]:
        d = (torch.randn(rows, k // t.block_size, generator=gen) * D_SCALE[t.name]).half()
        blocks[..., off : off + 2] = d.view(torch.uint8).view(rows, -1, 2)
    return blocks.reshape(rows, -1)


def random_gguf_expert(fmt: GGUFFormat, gen: torch.Generator, gate_up: str | None = None,
                       down: str | None = None) -> dict[str, torch.Tensor]:
    """One expert's loader form: gate, up [I, row bytes] and down [H, row bytes] of random blocks, in the given
    block types (default: the format's first of each)."""
    H, I = fmt.hidden_size, fmt.intermediate_size  # noqa: E741
    gate_up, down = gate_up or fmt.gate_up_types[0], down or fmt.down_types[0]
    return {"gate": random_blocks(gate_up, I, H, gen), "up": random_blocks(gate_up, I, H, gen),
            "down": random_blocks(down, H, I, gen)}
