"""GGUF experts: one expert's ggml blocks as stored in the file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
run natively.

GGUF stacks a layer's experts in ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H,
I]`` (numpy order; llama.cpp's ``ne`` reversed): expert ``e``'s rows of each are one contiguous byte range, a row
being one output feature with its K inputs in ggml blocks (:mod:`moeflow.kernels.experts.gguf_reference`). The region
holds those bytes unchanged, each matrix ``ALIGN``-aligned: ``gate`` uint8 ``[I, row_bytes]``, ``up`` the same, ``down``
uint8 ``[H, row_bytes']``, then ``types`` uint8 ``[2]``: the block types (``GGMLType.code``) of gate/up and of
down in this region. gate and up share one block type, down may have another; a format lists the one or two types
each may hold (:attr:`GGUFFormat.gate_up_types`, :attr:`GGUFFormat.down_types`), because one format serves every
layer of a model and llama.cpp's mixes vary by layer (Q4_K_M: gate/up Q4_K, down Q6_K in some layers and Q4_K in
the others). With two types a matrix's rows are sized for the wider and a narrower type's rows are padded (the
kernels read a region's ``types`` and branch); with one type the region is the file's bytes plus ``types``. The
loader form is the three matrices as the file stores them (their row size tells the type): :meth:`write` copies
and :meth:`loader_tensors` copies back.

How a GGUF reader builds and fills it: ``gguf_expert_format(gate_types, down_types, hidden, inter, dtype)`` with
the set of ``tensor_type`` s of ``blk.N.ffn_gate_exps`` (which must equal ``ffn_up_exps``' in each layer) and of
``ffn_down_exps`` over all layers N (a name, id or ``gguf.GGMLQuantizationType``, or a sequence of them), and per
expert ``fmt.write(region, {"gate": g[e], "up": u[e], "down": d[e]})`` where ``g`` is ``ffn_gate_exps``' data
as uint8 ``[E, I, row_bytes]`` (gguf-py's ``ReaderTensor.data`` has that shape for quantized types), likewise
``u``, and ``d`` ``[E, H, row_bytes]``; a disk tier reads the same three byte ranges.

Compute: SiLU gating, no biases, through the custom op ``torch.ops.moeflow.gguf_expert_forward`` (so
``torch.compile(fullgraph=True)`` traces through; it rebuilds the format from its types). Backend ``"triton"``:
:mod:`moeflow.kernels.experts.gguf` (grouped kernels decoding the blocks in the K loop, one w13 kernel reading gate
and up); ``"torch"``: the plain-torch reference (:func:`moeflow.kernels.experts.biased.biased_expert_forward_reference`
over :meth:`GGUFFormat.reference_weights`). Not in the fused eager MoE. CUDA-graph capture
(:meth:`GGUFFormat.captured_forward`): the same Triton kernels over persistent buffers, or a static torch form.

CPU form (hybrid compute, :meth:`GGUFFormat.cpu_expert`): Q4_0, Q8_0, Q4_K, Q5_K and Q6_K experts run
:mod:`moeflow.kernels.cpu.gguf` (native kernels over the same blocks, int8 activations as llama.cpp's CPU backend);
other types are refused by :meth:`GGUFFormat.cpu_unsupported`, naming them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from moeflow.kernels.custom_op import custom_op
from moeflow.kernels.experts.configs import decode_stage_configs, encode_stage_configs
from moeflow.kernels.experts.gguf_reference import GGML_TYPES, GGMLType, dequantize, ggml_type
from moeflow.kernels.formats.layout import ExpertFormat, ExpertPool

if TYPE_CHECKING:
    from moeflow.kernels.cpu.gguf import GGUFCpuExpert
    from moeflow.kernels.formats.layout import ReferenceWeights

MATRICES = ("gate", "up", "down")
MAX_TYPES_PER_MATRIX = 2  # the kernels branch between at most two block types per matrix


@dataclass(frozen=True)
class GGUFFormat(ExpertFormat):
    """Experts as GGUF blocks (module doc). ``gate_up_types`` / ``down_types``: the ggml type names (``"Q4_K"``)
    the matrices may hold, one or two each (two: a model whose layers differ, as Q4_K_M's down projections do);
    ``dtype``: the model's activation dtype (the blocks carry their own fp16 scales)."""

    gate_up_types: tuple[str, ...] = ()
    down_types: tuple[str, ...] = ()
    cpu_kernels: bool = False  # CPU pools computed by moeflow.kernels.cpu.gguf, not the torch reference
    kind: ClassVar[str] = "gguf"
    capturable: ClassVar[bool] = True  # the Triton kernels over alloc's buffers, or the static torch form
    # the fused eager MoE reads the plain layout only; CPU kernels for some types

    def __post_init__(self) -> None:
        for role, names, k in (("gate/up", self.gate_up_types, self.hidden_size),
                               ("down", self.down_types, self.intermediate_size)):
            if not names or len(names) > MAX_TYPES_PER_MATRIX:
                raise ValueError(f"a GGUF expert format needs 1 or {MAX_TYPES_PER_MATRIX} {role} block types (of "
                                 f"{sorted(GGML_TYPES)}), got {names!r}: build it with "
                                 "moeflow.kernels.formats.gguf_expert_format")
            types = [ggml_type(t) for t in names]  # a ValueError naming the supported types
            for g in types:
                if k % g.block_size:
                    raise ValueError(f"GGUF {role} experts in {g.name} need their input size ({k}) to be a multiple "
                                     f"of {g.block_size}")
            if len({g.row_bytes(k) for g in types}) < len(types):
                raise ValueError(f"GGUF {role} block types {names} have rows of the same size: one format cannot "
                                 "tell them apart (the types of a region are inferred from its rows' sizes)")
        super().__post_init__()

    def types_of(self, name: str) -> tuple[GGMLType, ...]:
        """The block types region tensor ``name`` ("gate", "up" or "down") may hold."""
        return tuple(ggml_type(t) for t in (self.down_types if name == "down" else self.gate_up_types))

    def row_bytes(self, name: str) -> int:
        """Bytes per row of region tensor ``name``: its widest type's (narrower rows are padded)."""
        return max(g.row_bytes(self.input_size(name)) for g in self.types_of(name))

    def input_size(self, name: str) -> int:
        return self.intermediate_size if name == "down" else self.hidden_size

    # ---- layout -------------------------------------------------------------------------------------------
    def region_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        rows = {"gate": I, "up": I, "down": H}
        # "types": the ggml type codes (GGMLType.code) of gate/up and of down in this region
        return [(n, torch.uint8, (rows[n], self.row_bytes(n))) for n in MATRICES] + [("types", torch.uint8, (2,))]

    def loader_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the loader form at the widest types (a narrower type's rows have fewer bytes)."""
        return {spec.name: spec.shape for spec in self.specs if spec.name in MATRICES}

    def _type_of_rows(self, name: str, t: torch.Tensor) -> GGMLType:
        rows = self.spec(name).shape[0]
        k = self.input_size(name)
        for g in self.types_of(name):
            if tuple(t.shape) == (rows, g.row_bytes(k)):
                return g
        want = " or ".join(f"{(rows, g.row_bytes(k))} ({g.name})" for g in self.types_of(name))
        raise ValueError(f"GGUF expert tensor {name!r} has shape {tuple(t.shape)}, expected {want}: rows of "
                         f"{k} inputs in blocks")

    def write(self, region: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one expert's blocks (``gate``, ``up``: uint8 ``[I, row_bytes]``; ``down``: ``[H, row_bytes]``, the
        row bytes telling the block type) into its region ``uint8 [nbytes]`` (names, shapes, dtypes checked)."""
        views = self.views(region.view(1, -1))
        found = {}
        for name in MATRICES:
            if name not in tensors:
                raise KeyError(f"missing GGUF expert tensor {name!r} (expected {MATRICES})")
            t = tensors[name]
            if t.dtype != torch.uint8:
                raise ValueError(f"GGUF expert tensor {name!r} must be the file's bytes (uint8), got {t.dtype}")
            found[name] = self._type_of_rows(name, t)
        if found["gate"] != found["up"]:
            raise ValueError(f"GGUF expert gate ({found['gate'].name}) and up ({found['up'].name}) must share a "
                             "block type")
        for name in MATRICES:
            rb = tensors[name].shape[1]
            views[name][0][:, :rb].copy_(tensors[name])
            views[name][0][:, rb:].zero_()  # padding of a narrower type: never read
        views["types"][0].copy_(torch.tensor([found["gate"].code, found["down"].code], dtype=torch.uint8))

    def region_types(self, region: torch.Tensor) -> tuple[GGMLType, GGMLType]:
        """(gate/up type, down type) of the expert in ``region`` ``uint8 [nbytes]``."""
        codes = self.views(region.view(1, -1))["types"][0].tolist()
        by_code = {g.code: g for g in GGML_TYPES.values()}
        return by_code[codes[0]], by_code[codes[1]]

    def loader_tensors(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self.views(region.view(1, -1))
        gate_up, down = self.region_types(region)
        out = {}
        for name in MATRICES:
            g = down if name == "down" else gate_up
            out[name] = views[name][0][:, : g.row_bytes(self.input_size(name))].clone()
        return out

    # ---- compute ------------------------------------------------------------------------------------------
    def reference_weights(self, pool: ExpertPool, slot: int) -> ReferenceWeights:
        gate_up, down = self.region_types(pool.buffer[slot])
        t = self.loader_tensors(pool.buffer[slot])
        w13 = torch.cat([dequantize(t["gate"], gate_up.name), dequantize(t["up"], gate_up.name)])
        return w13, None, dequantize(t["down"], down.name), None

    def check_pool(self, pool: ExpertPool) -> None:
        for name in MATRICES:
            v = pool.tensors[name]
            if v.dtype != torch.uint8 or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
                raise ValueError(f"GGUF pool tensor {name!r}: rows of blocks must be contiguous uint8")

    def forward(self, x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, backend, *,
                config=None, validate=None):  # noqa: D102 (see ExpertFormat.forward)
        """Checks, then the custom op ``torch.ops.moeflow.gguf_expert_forward`` (so ``torch.compile(fullgraph=True)``
        traces through): backend "triton" the kernels of :mod:`moeflow.kernels.experts.gguf`, "torch" the
        plain-torch reference."""
        from moeflow.kernels.experts.checks import check_expert_args, check_ids_and_slots, values_checked

        check_expert_args(x, topk_ids, topk_weights, slot_of_expert, out, expert_mask, self.hidden_size)
        if pool.device != x.device:
            raise ValueError(f"the GGUF expert pool is on {pool.device} but x is on {x.device}")
        if not pool.checked:
            self.check_pool(pool)
            pool.checked = True
        if values_checked(validate, topk_ids):
            check_ids_and_slots(topk_ids, slot_of_expert, expert_mask, pool.n_slots)
        if topk_ids.numel() == 0:
            return out
        flat_cfg = encode_stage_configs(config)
        if self.cpu_kernels and backend == "torch" and x.device.type == "cpu":
            backend = "cpu"  # the op's own name for moeflow.kernels.cpu.gguf
        _gguf_expert_forward_op(x, topk_ids, topk_weights, pool.buffer, slot_of_expert, expert_mask,
                                self.hidden_size, self.intermediate_size, "+".join(self.gate_up_types),
                                "+".join(self.down_types), self.dtype, flat_cfg, backend, out)
        return out

    def capture_unsupported(self, backend: str) -> str | None:
        if self.cpu_kernels and backend == "torch":
            return "GGUF experts computed by moeflow's native CPU kernels (cpu_kernels) are not device work"
        return None

    def captured_forward(self, pool, x, topk_ids, topk_weights, slot_of_expert, expert_mask, out, backend,
                         alloc):  # noqa: D102 (see ExpertFormat.captured_forward)
        from moeflow.kernels.experts.capturable import static_biased_forward

        if backend == "triton":  # the launch config is a function of T: fixed per bucket
            from moeflow.kernels.experts.gguf import gguf_expert_forward

            def compute() -> None:
                gguf_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, alloc=alloc)
            return compute
        t = pool.tensors

        def matrix(name: str, slot: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
            """fp32 [N, K]: every type the matrix may hold dequantized, the region's chosen on the device."""
            rows, k = t[name].index_select(0, slot)[0], self.input_size(name)
            types = self.types_of(name)
            ws = [dequantize(rows[:, : g.row_bytes(k)], g.name) for g in types]
            if len(ws) == 1:
                return ws[0]
            return torch.where(codes[1 if name == "down" else 0] == types[0].code, ws[0], ws[1])

        def weights_of(slot: torch.Tensor):
            codes = t["types"].index_select(0, slot)[0]
            w13 = torch.cat([matrix("gate", slot, codes), matrix("up", slot, codes)])
            return w13, None, matrix("down", slot, codes), None

        def compute_torch() -> None:
            static_biased_forward(x, topk_ids, topk_weights, self, slot_of_expert, expert_mask, out, weights_of)
        return compute_torch

    def with_cpu_kernels(self) -> GGUFFormat:
        """This format with ``cpu_kernels``: its pools on the CPU computed by the native kernels of
        :mod:`moeflow.kernels.cpu.gguf` (the CPU form's, so slots and hybrid compute give the same bits) where
        backend "torch" would run the fp32 reference. A ValueError when the types have no CPU kernels."""
        problem = self.cpu_unsupported()
        if problem is not None:
            raise ValueError(f"GGUF experts cannot use the CPU kernels: {problem}")
        return _gguf_format(self.gate_up_types, self.down_types, self.hidden_size, self.intermediate_size,
                            self.dtype, True)

    def cpu_unsupported(self) -> str | None:
        """None when every block type of this format has CPU kernels (:mod:`moeflow.kernels.cpu.gguf`: Q8_0, Q4_K,
        Q5_K, Q6_K) and they build here, else why not."""
        from moeflow.kernels.cpu.gguf import CPU_TYPES
        from moeflow.kernels.cpu.native import native_available

        missing = [t for t in (*self.gate_up_types, *self.down_types) if t not in CPU_TYPES]
        if missing:
            return (f"the experts hold GGUF {'/'.join(dict.fromkeys(missing))} blocks, which have no CPU kernels "
                    f"(the CPU computes GGUF {', '.join(CPU_TYPES)} experts, AWQ 4-bit and MXFP4)")
        if not native_available():
            return "moeflow's CPU kernels do not build here (no C compiler, or MOEFLOW_CPU_NATIVE=0)"
        return None

    def cpu_expert(self, tensors: dict[str, torch.Tensor]):  # -> GGUFCpuExpert
        """The expert's CPU form: its loader-form blocks (``gate``, ``up``, ``down`` as the file stores them,
        the row sizes telling the types) computed in place by :class:`~moeflow.kernels.cpu.gguf.GGUFCpuExpert`."""
        from moeflow.kernels.cpu.gguf import GGUFCpuExpert

        problem = self.cpu_unsupported()
        if problem is not None:
            raise ValueError(f"no CPU form for these GGUF experts: {problem}")
        gate_up, down = self._type_of_rows("gate", tensors["gate"]), self._type_of_rows("down", tensors["down"])
        if self._type_of_rows("up", tensors["up"]) != gate_up:
            raise ValueError(f"GGUF expert gate ({gate_up.name}) and up must share a block type")
        return GGUFCpuExpert(tensors["gate"].cpu(), tensors["up"].cpu(), tensors["down"].cpu(), gate_up, down)

    def cpu_region_expert(self, region: torch.Tensor):  # -> GGUFCpuExpert
        """The CPU form of the expert in ``region`` ``uint8 [nbytes]``: views of its blocks as stored (a narrower
        type's padded rows read by their stride), no copy: the kernels compute the region's bytes in place."""
        from moeflow.kernels.cpu.gguf import GGUFCpuExpert

        problem = self.cpu_unsupported()
        if problem is not None:
            raise ValueError(f"no CPU form for these GGUF experts: {problem}")
        if region.device.type != "cpu":
            return None
        if region.dtype != torch.uint8 or tuple(region.shape) != (self.nbytes,):
            raise ValueError(f"a GGUF expert region is uint8 [{self.nbytes}], got {region.dtype} {tuple(region.shape)}")
        # every tensor of the region is uint8: plain slices (GGUFFormat.views' checks cost more than the form)
        views = {name: region[spec.offset : spec.offset + spec.nbytes].view(spec.shape) for name in (*MATRICES, "types")
                 for spec in (self.spec(name),)}
        by_code = {g.code: g for g in GGML_TYPES.values()}
        gate_up, down = (by_code[c] for c in views["types"].tolist())
        return GGUFCpuExpert(views["gate"], views["up"], views["down"], gate_up, down)


def gguf_expert_format(gate_up_types: str | int | Sequence[str | int], down_types: str | int | Sequence[str | int],
                       hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> GGUFFormat:
    """The GGUF format whose ``ffn_gate_exps`` / ``ffn_up_exps`` hold ggml type(s) ``gate_up_types`` and
    ``ffn_down_exps`` ``down_types``: each a type (a name such as ``"Q4_K"``, a ggml type id, a
    ``gguf.GGMLQuantizationType``) or the sequence of the (at most two) types a model's layers use, e.g.
    ``("Q4_K", "Q6_K")`` for Q4_K_M's down projections. ``dtype`` is the model's activation dtype. A ValueError
    names the supported types (:data:`moeflow.kernels.experts.gguf_reference.GGML_TYPES`)."""
    def names(types) -> tuple[str, ...]:
        seq = [types] if isinstance(types, str | int) else list(types)
        return tuple(sorted({ggml_type(t).name for t in seq}, key=lambda n: ggml_type(n).code))

    return _gguf_format(names(gate_up_types), names(down_types), hidden_size, intermediate_size, dtype)


@functools.lru_cache(maxsize=64)
def _gguf_format(gate_up: tuple[str, ...], down: tuple[str, ...], hidden: int, inter: int,
                 dtype: torch.dtype, cpu_kernels: bool = False) -> GGUFFormat:
    return GGUFFormat(hidden, inter, dtype, gate_up_types=gate_up, down_types=down, cpu_kernels=cpu_kernels)


def _cpu_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: ExpertPool,
                 slot_of_expert: torch.Tensor, out: torch.Tensor, expert_mask: torch.Tensor | None) -> None:
    """out[pairs of each selected expert] = its CPU form over the slot's bytes (views, no copy): the numbers
    hybrid compute's CPU form gives (x [T, H], topk int [T, k], out [T*k, H]; :func:`cpu_forms_forward`)."""
    from moeflow.kernels.cpu.gguf import GGUFCpuExpert

    fmt, t = pool.fmt, pool.tensors
    by_code = {g.code: g for g in GGML_TYPES.values()}
    types_at = fmt.spec("types").offset
    slots = slot_of_expert.tolist()

    def form(e: int) -> GGUFCpuExpert:
        s = slots[e]
        gate_up, down = (by_code[c] for c in pool.buffer[s, types_at : types_at + 2].tolist())
        return GGUFCpuExpert(t["gate"][s], t["up"][s], t["down"][s], gate_up, down)
    cpu_forms_forward(x, topk_ids, topk_weights, form, out, expert_mask)


def cpu_forms_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      form: Callable[[int], GGUFCpuExpert], out: torch.Tensor,
                      expert_mask: torch.Tensor | None = None) -> None:
    """out[pairs of each selected expert] = ``form(expert)``'s output on them: each expert once on all its rows
    (x [T, H], topk_ids int [T, k], topk_weights [T, k], out [T*k, H]; ``expert_mask`` bool [E]: False skips
    that expert). The GGUF pools' CPU path and :class:`~moeflow.engine.mapped_experts.MappedGGUFExperts` (forms
    over a mapped file) share it, so both give the same bits. Host-side bookkeeping in plain Python lists (a
    decode step's layer is a few experts on one row)."""
    k = topk_ids.shape[1]
    mask = None if expert_mask is None else expert_mask.tolist()
    groups: dict[int, list[int]] = {}
    for pair, e in enumerate(topk_ids.reshape(-1).tolist()):
        groups.setdefault(e, []).append(pair)
    flat_w = topk_weights.reshape(-1).float()
    for e, pairs in groups.items():
        if mask is not None and not mask[e]:
            continue
        expert = form(e)
        if len(pairs) == 1:
            p = pairs[0]
            out[p : p + 1] = expert.forward(x[p // k : p // k + 1], flat_w[p : p + 1]).to(out.dtype)
        else:
            idx = torch.tensor(pairs)
            out[idx] = expert.forward(x[idx // k], flat_w[idx]).to(out.dtype)


@custom_op("moeflow::gguf_expert_forward", mutates_args=("out",))
def _gguf_expert_forward_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, buffer: torch.Tensor,
    slot_of_expert: torch.Tensor, expert_mask: torch.Tensor | None, hidden: int, inter: int, gate_up_types: str,
    down_types: str, dtype: torch.dtype, config: list[int], backend: str, out: torch.Tensor,
) -> None:
    """out[pairs of selected experts] = weighted expert outputs; the pool is ``buffer`` uint8 [S, nbytes] of the
    GGUF format with these types ("Q4_K" or "Q4_K+Q6_K"); backend "triton", "torch" (the fp32 reference) or
    "cpu" (:mod:`moeflow.kernels.cpu.gguf`)."""
    fmt = gguf_expert_format(gate_up_types.split("+"), down_types.split("+"), hidden, inter, dtype)
    pool = ExpertPool(fmt, buffer)
    if backend == "cpu":
        _cpu_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)
        return
    if backend == "triton":
        from moeflow.kernels.experts.gguf import gguf_expert_forward

        cfg = decode_stage_configs(config)
        gguf_expert_forward(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask, config=cfg)
        return
    from moeflow.kernels.experts.biased import biased_expert_forward_reference

    biased_expert_forward_reference(x, topk_ids, topk_weights, pool, slot_of_expert, out, expert_mask)


@_gguf_expert_forward_op.register_fake
def _(x, topk_ids, topk_weights, buffer, slot_of_expert, expert_mask, hidden, inter, gate_up_types, down_types,
      dtype, config, backend, out):
    return None
