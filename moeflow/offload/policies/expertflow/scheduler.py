"""ExpertFlow's token scheduler: regroup sequences into micro-batches with similar routing paths.

A routing path is a boolean ``[L, E]`` matrix (expert e of layer l is active for the token). A
micro-batch activates the OR of its members' paths; fewer activated (layer, expert) pairs per
micro-batch means fewer expert loads and more tokens per loaded expert (ExpertFlow §3.3, eqs. 4-6).

The heuristic is the paper's balanced k-means on Hamming similarity
``S_ij = 1 - hamming(R_i, R_j) / (L * E)``: random initial centroids, each sequence to the most
similar centroid that still has room (clusters balanced to at most ``micro_batch_size``), centroids
re-chosen as the member with the highest mean similarity to the others (a medoid), until the
assignment stops changing. A contiguous split (balanced, or in chunks of ``micro_batch_size``, what
running without the scheduler does) is kept when k-means does not beat it (moeflow's variant;
``keep_contiguous=False`` returns the clustering as the paper does). :func:`regroup_two_batches` is the paper's
problem statement (§3.3.2): the tokens of two batches into two balanced batches.
"""

from __future__ import annotations

import math

import torch


def _check_paths(paths: torch.Tensor) -> torch.Tensor:
    if paths.dim() != 3:
        raise ValueError(f"paths must be a boolean [batch, layers, experts] tensor, got shape {tuple(paths.shape)}")
    return paths.bool().reshape(paths.shape[0], -1)


def routing_similarity(paths: torch.Tensor) -> torch.Tensor:
    """paths bool [B, L, E] -> similarity [B, B] = 1 - hamming / (L*E)."""
    flat = _check_paths(paths).float()
    n = flat.shape[1]
    common_on = flat @ flat.T
    common_off = (1 - flat) @ (1 - flat).T
    return (common_on + common_off) / n


def activated_pairs(paths: torch.Tensor, groups: list[list[int]]) -> int:
    """Total number of (layer, expert) pairs the groups activate: sum over groups of |OR of members' paths|."""
    flat = _check_paths(paths)
    return sum(int(flat[g].any(dim=0).sum()) for g in groups if g)


def _group_sizes(batch: int, micro_batch_size: int) -> list[int]:
    n_groups = math.ceil(batch / micro_batch_size)
    base, extra = divmod(batch, n_groups)
    return [base + (1 if g < extra else 0) for g in range(n_groups)]


def balanced_split(batch: int, micro_batch_size: int) -> list[list[int]]:
    """``range(batch)`` in row order as ceil(batch / micro_batch_size) micro-batches of near-equal size (the
    contiguous split the clustering is balanced like)."""
    groups, start = [], 0
    for s in _group_sizes(batch, micro_batch_size):
        groups.append(list(range(start, start + s)))
        start += s
    return groups


def _assign(sim_to_centroids: torch.Tensor, sizes: list[int]) -> list[list[int]]:
    """Most confident sequences first, each to its most similar centroid that still has room."""
    batch, n_groups = sim_to_centroids.shape
    room = list(sizes)
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    best = sim_to_centroids.max(dim=1).values
    for i in torch.argsort(best, descending=True, stable=True).tolist():
        for g in torch.argsort(sim_to_centroids[i], descending=True, stable=True).tolist():
            if room[g]:
                groups[g].append(i)
                room[g] -= 1
                break
    return [sorted(g) for g in groups]


def group_by_routing(
    paths: torch.Tensor, micro_batch_size: int, max_iters: int = 20, seed: int = 0, keep_contiguous: bool = True
) -> list[list[int]]:
    """Partition ``range(B)`` into groups of at most ``micro_batch_size`` that activate few experts.

    paths: bool [B, L, E] routing paths (observed, or predicted for a first step).
    keep_contiguous: moeflow's variant, the contiguous split when k-means does not activate fewer pairs; False:
    the k-means assignment as the paper takes it (§3.3.3), whatever it activates.
    Returns the groups as sorted index lists, in order of their smallest member.
    """
    batch = paths.shape[0]
    flat = _check_paths(paths)
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or micro_batch_size > batch:
        raise ValueError(f"micro_batch_size must be an integer in [1, batch={batch}], got {micro_batch_size!r}")
    sizes = _group_sizes(batch, micro_batch_size)
    balanced = balanced_split(batch, micro_batch_size)
    chunked = [list(range(i, min(i + micro_batch_size, batch))) for i in range(0, batch, micro_batch_size)]
    if len(sizes) == 1 or micro_batch_size == 1:
        return chunked
    sim = routing_similarity(flat.reshape(paths.shape))
    gen = torch.Generator().manual_seed(seed)
    centroids = torch.randperm(batch, generator=gen)[: len(sizes)].tolist()
    groups: list[list[int]] = []
    for _ in range(max_iters):
        new_groups = _assign(sim[:, centroids], sizes)
        if new_groups == groups:
            break
        groups = new_groups
        centroids = [g[int(sim[g][:, g].mean(dim=1).argmax())] for g in groups]
    if not keep_contiguous:
        return sorted(groups, key=lambda g: g[0])
    best = min((chunked, balanced, groups), key=lambda g: activated_pairs(paths, g))  # ties: contiguous first
    return sorted(best, key=lambda g: g[0])


def regroup_two_batches(paths_a: torch.Tensor, paths_b: torch.Tensor, *, keep_contiguous: bool = False,
                        seed: int = 0) -> tuple[list[int], list[int]]:
    """ExpertFlow's token scheduler as written (§3.3.2): the tokens of two batches of N, with global indices
    0..N-1 (batch A) and N..2N-1 (batch B), into two new balanced batches of N that activate few experts.

    paths_a, paths_b: bool [N, L, E] token routing paths. keep_contiguous=True keeps A and B when the clustering
    does not activate fewer (layer, expert) pairs (moeflow's variant). Returns the two index lists, sorted."""
    if paths_a.shape != paths_b.shape:
        raise ValueError(f"the two batches' paths differ in shape: {tuple(paths_a.shape)} vs {tuple(paths_b.shape)}")
    paths = torch.cat([paths_a, paths_b])
    n = paths_a.shape[0]
    first, second = group_by_routing(paths, n, seed=seed, keep_contiguous=keep_contiguous)
    return first, second
