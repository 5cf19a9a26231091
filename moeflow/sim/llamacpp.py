"""llama.cpp's own expert placement as a simulated baseline: ``llamacpp-n-cpu-moe``.

``llama-server -ngl 99 --n-cpu-moe N`` keeps the expert weights (``ffn_*_exps``) of the first N layers in host
memory and everything else on the GPU (``common/arg.cpp``: "keep the Mixture of Experts (MoE) weights of the first
N layers in the CPU"; it is ``--override-tensor blk.i.ffn_(up|down|gate)_exps=CPU`` for i < N). There is no cache
and no scheduler: the graph runs layer after layer, and at a layer whose experts are on the CPU the GPU's
activations go to the host (the graph split waits for the GPU), the CPU computes the layer's routed experts in one
call with all its threads, and the rows go back before the next layer starts: **the GPU and the CPU never work at
the same time** within a pass. For batches of at least 32 tokens (prefill) llama.cpp's op offload copies the used
experts' weights to the GPU and computes them there instead (``GGML_OP_OFFLOAD_MIN_BATCH``).

A slot budget of S slots places ``S // num_experts`` whole layers on the GPU (the last ones), so
N = ``num_layers - S // num_experts``. The CPU's speed is the profile's (moeflow's kernel speeds stand for
llama.cpp's); one call per layer pays ``cpu_call_us`` once.
"""

from __future__ import annotations

import torch

from moeflow.sim.engine import SimClock, SimTransport
from moeflow.sim.profile import HardwareProfile
from moeflow.trace import Trace

LLAMACPP_POLICY = "llamacpp-n-cpu-moe"
OP_OFFLOAD_MIN_BATCH = 32  # llama.cpp offloads an op on host weights to the GPU from this batch size


def n_cpu_moe(slots: int, num_layers: int, num_experts: int) -> int:
    """``--n-cpu-moe`` for a budget of ``slots`` expert slots: the layers whose experts do not fit whole."""
    return num_layers - min(num_layers, slots // num_experts)


def cpu_layer_s(profile: HardwareProfile, counts: list[int]) -> float:
    """One llama.cpp CPU call over a layer's routed experts (``counts[e]`` tokens each): the call cost once, each
    used expert's weights streamed, and the tokens past the free ones."""
    used = [n for n in counts if n]
    return profile.cpu_call_us * 1e-6 + sum(profile.cpu_weights_s() + profile.cpu_extra_tokens_s(n) for n in used)


def llamacpp_moe_layer(transport: SimTransport, clock: SimClock, profile: HardwareProfile, layer: int,
                       counts: list[int], tokens: int, on_cpu: bool) -> tuple[float, int]:
    """The MoE part of ``layer`` after its attention (already on the compute stream); returns (CPU seconds spent,
    bytes copied to the GPU)."""
    used = [e for e, n in enumerate(counts) if n]
    gpu_s = sum(profile.expert_s(counts[e]) for e in used)
    label = f"L{layer} E{','.join(map(str, used))}"
    if not on_cpu:
        transport.compute(gpu_s, "expert", label)
        return 0.0, 0
    if tokens >= OP_OFFLOAD_MIN_BATCH:  # op offload: the used experts' weights copied over, computed on the GPU
        start = max(transport.copy_free, transport.compute_free)
        end = start + len(used) * (profile.expert_bytes / profile.bandwidth_bps + profile.h2d_latency_us * 1e-6)
        transport.copy_free = end
        transport.copy_busy_s += end - start
        transport.log("copy", "needed", start, end, label)
        transport.stall_s += max(0.0, end - max(transport.compute_free, clock.now))
        transport.compute_free = max(transport.compute_free, end)
        transport.compute(gpu_s, "expert", label)
        return 0.0, len(used) * profile.expert_bytes
    clock.advance_to(transport.compute_free)  # the graph split: the activations reach the host
    seconds = cpu_layer_s(profile, counts)
    transport.log("cpu", "expert", clock.now, clock.now + seconds, label)
    clock.advance_to(clock.now + seconds)  # the rows go back; the next layer starts after them
    return seconds, 0


def analytic_llamacpp_step_s(trace: Trace, profile: HardwareProfile, rows: slice, n_cpu: int) -> float:
    """Closed form of one pass over ``rows`` (fewer than 32 tokens) with ``--n-cpu-moe n_cpu``: per layer attention,
    then its experts on the GPU, or (first ``n_cpu`` layers) one CPU call; plus the head."""
    T = rows.stop - rows.start
    total = profile.head_s
    for l in range(trace.num_layers):
        counts = torch.bincount(trace.topk_ids[rows, l].reshape(-1).long(), minlength=trace.num_experts).tolist()
        moe = cpu_layer_s(profile, counts) if l < n_cpu else sum(profile.expert_s(n) for n in counts if n)
        total += profile.attn_s(T) + moe
    return total
