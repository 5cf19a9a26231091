"""How an expert region is cut into copy chunks: equal aligned pieces, or one chunk per linear layer (ProMoE §5.1)."""

from __future__ import annotations

from moeflow.kernels.formats import ALIGN, ExpertFormat


def chunk_ranges(nbytes: int, chunks: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into at most ``chunks`` aligned, contiguous, non-empty byte ranges."""
    step = max(align, -(-nbytes // chunks // align) * align)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def linear_chunks(fmt: ExpertFormat) -> list[tuple[int, int]]:
    """ProMoE §5.1's chunks: one contiguous byte range per linear layer of an expert region, covering it.

    A tensor's linear layer is its name's prefix (``w13``, ``w2``); a dense ``w13`` [2I, H] is the gate's rows then
    the up's, so it splits in two at the middle (when that is ALIGN-aligned): gate, up, down. An AWQ ``w13`` holds
    gate and up interleaved within each panel, so its tensors stay one chunk: (gate + up), down."""
    starts: dict[str, int] = {}
    for spec in fmt.specs:
        starts.setdefault(spec.name.split("_")[0], spec.offset)
    bounds = sorted(starts.values())
    if fmt.w13_halves:
        w13 = fmt.spec("w13")
        if (w13.nbytes // 2) % ALIGN == 0:
            bounds.append(w13.offset + w13.nbytes // 2)
    bounds = sorted(set(bounds) - {0})
    edges = [0, *bounds, fmt.nbytes]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
