"""One memory budget for the device and the host: what every part of the model takes, and whether it fits.

``OffloadConfig(gpu_memory_gb=G, host_memory_gb=H)``: the device holds the non-expert weights, the KV cache for
``context_length`` tokens of ``max_batch_size`` sequences, the activations and kernel workspaces of a prefill of
that size, the private memory pools of the decode step's CUDA graphs (when captured), and as many expert slots as
are left; the host holds the experts that fit in H (the rest stay on
disk, :mod:`moeflow.offload.disk_tier`), plus the non-expert weights and KV cache when the device is the CPU.
"auto" takes what the device (``torch.cuda.mem_get_info``) or the machine (MemAvailable) has free, minus a
margin. :class:`MemoryPlan` is the split (``model.memory_plan()``, printed by the CLI).

Activations, workspaces and graph pools are estimates (stated in :func:`activation_bytes` and
:func:`graph_pool_bytes`): the largest tensors of one prefill step, and of the captured decode steps, not a
measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moeflow.config import OffloadConfig
from moeflow.errors import SchedulingError
from moeflow.moe.backend import ExpertBackend
from moeflow.offload.backend import OffloadedExperts
from moeflow.offload.units import format_bytes

GiB = 2**30
DEFAULT_CONTEXT = 4096  # tokens the KV cache is sized for when OffloadConfig.context_length is None
GPU_AUTO_MARGIN = 0.10  # "auto" leaves this share of the device's free memory (allocator fragmentation, CUDA context)
GPU_AUTO_MIN_MARGIN = 512 * 2**20
GRAPH_STEPS = 16  # captured decode steps kept at once (CudaGraphDecode's max_steps), each with its own pool
POOL_GRANULE = 2 * 2**20  # the caching allocator's smallest segment: a pool holds at least one


@dataclass
class MemoryPlan:
    """Bytes of each part; ``*_budget`` None where no budget was given. ``as_dict()`` / ``summary()``."""

    device: str
    context_length: int
    batch: int
    gpu_budget: int | None
    non_expert: int
    kv_cache: int
    activations: int
    workspace: int
    expert_slots: int
    expert_bytes: int  # one expert in the slot layout
    total_experts: int
    host_budget: int | None = None
    host_reserved: int = 0  # non-expert weights and KV cache when they live in host memory (CPU device)
    staging: int = 0  # the disk readers' buffers
    host_experts: int = 0  # experts kept in host memory (the rest are read from disk)
    graph_pools: int = 0  # the captured decode steps' private memory pools (0: no CUDA graphs)
    # hybrid compute's CPU forms converted beside the host store (AWQ 1.02x, MXFP4 2.35x an expert's bytes; GGUF and
    # a CPU device's int4 store are computed in place: 0). A disk tier builds them on use: not counted
    cpu_forms: int = 0

    @property
    def gpu_used(self) -> int:
        return reserved_device_bytes(self) + self.expert_slots * self.expert_bytes

    @property
    def host_used(self) -> int:
        return self.host_reserved + self.staging + self.host_experts * self.expert_bytes + self.cpu_forms

    def as_dict(self) -> dict:
        return {**asdict(self), "gpu_used": self.gpu_used, "host_used": self.host_used}

    def summary(self) -> str:
        def g(n):
            return f"{'-' if n is None else _gb(n):>10}"

        lines = [
            f"memory plan ({self.device}; KV cache for {self.context_length} tokens x {self.batch} sequences)",
            f"  device budget   {g(self.gpu_budget)}   used {g(self.gpu_used)}",
            f"    non-expert weights {g(self.non_expert)}",
            f"    KV cache           {g(self.kv_cache)}",
            f"    activations        {g(self.activations)}",
            f"    workspaces         {g(self.workspace)}",
            f"    CUDA graph pools   {g(self.graph_pools)}",
            f"    expert slots       {g(self.expert_slots * self.expert_bytes)}  ({self.expert_slots} of "
            f"{self.total_experts} experts)",
            f"  host budget     {g(self.host_budget)}   used {g(self.host_used)}",
            f"    weights + KV       {g(self.host_reserved)}",
            f"    disk staging       {g(self.staging)}",
            f"    expert cache       {g(self.host_experts * self.expert_bytes)}  ({self.host_experts} of "
            f"{self.total_experts} experts; {self.total_experts - self.host_experts} read from disk)",
        ]
        if self.cpu_forms:
            lines.append(f"    CPU expert forms   {g(self.cpu_forms)}  (hybrid compute's converted experts)")
        return "\n".join(lines)


def kv_cache_bytes(cfg, dtype: torch.dtype, tokens: int, batch: int = 1, bytes_per_token: int | None = None) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``tokens`` (capped at the model's context).
    ``bytes_per_token``: what the family's cache costs per token over all layers (a latent cache is smaller);
    None: full keys and values of ``num_key_value_heads x head_dim``."""
    tokens = min(cfg.max_position_embeddings, tokens)
    if bytes_per_token is None:
        bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return batch * tokens * bytes_per_token


def activation_bytes(cfg, dtype: torch.dtype, tokens: int, batch: int, top_k: int, intermediate: int) -> int:
    """Largest live tensors of a prefill of ``batch x tokens``: the residual stream and one layer's attention
    (x, q, k, v, out: ~6 [N, H]), the attention scores of one layer (fp32 [B, heads, T, T] when the math path
    is used), and the fp32 logits [N, vocab]. N = batch * tokens."""
    n = batch * tokens
    stream = 6 * n * cfg.hidden_size * dtype.itemsize
    scores = batch * cfg.num_attention_heads * tokens * tokens * 4
    logits = n * cfg.vocab_size * 4
    return stream + scores + logits


def workspace_bytes(cfg, dtype: torch.dtype, tokens: int, batch: int, top_k: int, intermediate: int) -> int:
    """The expert kernels' buffers for one MoE layer: ``out [N*k, H]``, the gate/up activations
    ``[N*k, 2I]`` and the routing (probs fp32 [N, E] are under activations)."""
    n = batch * tokens * top_k
    return n * cfg.hidden_size * dtype.itemsize + n * 2 * intermediate * 4


def graph_pool_bytes(cfg, dtype: torch.dtype, context: int, batch: int, top_k: int, intermediate: int,
                     steps: int = GRAPH_STEPS) -> int:
    """Private memory pools of ``steps`` captured decode steps of ``batch`` rows over ``context`` keys (an upper
    bound: steps of smaller batches or key buckets hold less). One step's pool holds what its pieces allocate: the
    residual stream and one layer's attention tensors (~6 [B, H]), each piece's static output (one [B, H] per
    layer), the attention scores of one layer (fp32 [B, heads, context]), the fp32 logits [B, vocab] and the expert
    kernels' buffers (:func:`workspace_bytes` for one token per row), rounded up to the allocator's 2 MiB segment."""
    if steps <= 0:
        return 0
    layers = cfg.num_hidden_layers
    stream = (6 + layers) * batch * cfg.hidden_size * dtype.itemsize
    scores = batch * cfg.num_attention_heads * context * 4
    logits = batch * cfg.vocab_size * 4
    step = stream + scores + logits + workspace_bytes(cfg, dtype, 1, batch, top_k, intermediate)
    return steps * -(-step // POOL_GRANULE) * POOL_GRANULE


def device_free_bytes(device: torch.device) -> int:
    """What the device has free now: CUDA's free memory, or the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    from moeflow.offload.disk_tier import available_host_bytes

    return available_host_bytes()


def resolve_gpu_budget(config: OffloadConfig, device: torch.device) -> float | None:
    """``gpu_memory_gb`` as GB ("auto": free minus max(10%, 512 MiB)); None without a budget."""
    if config.gpu_memory_gb != "auto":
        return config.gpu_memory_gb
    free = device_free_bytes(device)
    return (free - max(free * GPU_AUTO_MARGIN, GPU_AUTO_MIN_MARGIN)) / GiB


def plan_device(config: OffloadConfig, *, cfg, device: torch.device, dtype: torch.dtype, non_expert: int,
                expert_bytes: int, total_experts: int, top_k: int, intermediate: int, min_slots: int,
                offloads: bool, kv_bytes_per_token: int | None = None, kv_bytes_per_sequence: int = 0,
                graph_steps: int = 0) -> MemoryPlan:
    """The device side of the plan (slots filled in once the backend exists). Refuses, naming every part,
    when a budget leaves fewer than ``min_slots`` expert slots (all experts for a policy that does not offload).
    ``graph_steps``: decode steps captured as CUDA graphs (0: none), whose pools the plan reserves."""
    tokens = min(cfg.max_position_embeddings, config.context_length or DEFAULT_CONTEXT)
    batch = config.max_batch_size
    plan = MemoryPlan(
        device=str(device), context_length=tokens, batch=batch, gpu_budget=None, non_expert=non_expert,
        kv_cache=kv_cache_bytes(cfg, dtype, tokens, batch, kv_bytes_per_token) + batch * kv_bytes_per_sequence,
        activations=activation_bytes(cfg, dtype, tokens, batch, top_k, intermediate),
        workspace=workspace_bytes(cfg, dtype, tokens, batch, top_k, intermediate),
        expert_slots=0, expert_bytes=expert_bytes, total_experts=total_experts,
        graph_pools=graph_pool_bytes(cfg, dtype, tokens, batch, top_k, intermediate, graph_steps))
    budget_gb = resolve_gpu_budget(config, device)
    if budget_gb is None:
        return plan
    plan.gpu_budget = int(budget_gb * GiB)
    need = min_slots if offloads else total_experts
    left = plan.gpu_budget - plan.gpu_used
    if left < need * expert_bytes:
        source = f"gpu_memory_gb={config.gpu_memory_gb}" + (f" ({budget_gb:.3g} GB free)"
                                                            if config.gpu_memory_gb == "auto" else "")
        raise SchedulingError(
            f"{source} does not fit: non-expert weights {_gb(plan.non_expert)}, KV cache {_gb(plan.kv_cache)} "
            f"({tokens} tokens x {batch} sequences), activations {_gb(plan.activations)}, workspaces "
            f"{_gb(plan.workspace)}" + (f", CUDA graph pools {_gb(plan.graph_pools)}" if plan.graph_pools else "")
            + f" leave {_gb(max(left, 0))} for experts, but at least {need} expert slots of "
            f"{_gb(expert_bytes)} are needed ({_gb(need * expert_bytes)}); give more memory, a shorter "
            "context_length or a smaller max_batch_size" + ("" if offloads else ", or an offloading policy")
            + (" (or cuda_graphs=False)" if plan.graph_pools else ""))
    return plan


def reserved_device_bytes(plan: MemoryPlan) -> int:
    """Everything on the device but the expert slots (what ``resolve_slots`` subtracts from the budget)."""
    return plan.non_expert + plan.kv_cache + plan.activations + plan.workspace + plan.graph_pools


def _gb(n: int) -> str:
    return format_bytes(n)


def fill_from_backend(plan: MemoryPlan, backend: ExpertBackend, config: OffloadConfig,
                      staging_per_reader: int) -> None:
    """Complete ``plan`` with what the backend allocated: device slots, host rows, disk staging (every expert on
    the device and none on the host for a backend that does not offload)."""
    from moeflow.offload.disk_tier import host_memory_bytes

    total = plan.total_experts
    offloaded = isinstance(backend, OffloadedExperts)
    plan.expert_slots = backend.n_slots if offloaded else total
    host = backend.host if offloaded else None
    on_cpu = plan.device.startswith("cpu")
    if config.host_memory_gb is not None:
        plan.host_budget = int(host_memory_bytes(config))
    plan.host_reserved = plan.non_expert + plan.kv_cache if on_cpu else 0
    if host is not None and host.on_disk:
        plan.host_experts = host.capacity
        plan.staging = config.disk_readers * staging_per_reader
    elif host is not None or on_cpu:
        plan.host_experts = total
    if host is not None and not host.on_disk:
        plan.cpu_forms = host.cpu_nbytes  # built when loading finished (HybridCompute.prepare)
