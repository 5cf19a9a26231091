"""Expert compute: routing, grouped expert GEMMs reading a slot pool, the combine, and an AWQ linear.

``backend`` selects the implementation: ``"torch"`` (the reference in :mod:`.reference`), ``"triton"``
(Triton kernels; on a CPU they run under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA, torch
otherwise). The entry points live in :mod:`.dispatch`; a pool's weight format (:mod:`.formats`) chooses its own
kernels. See ``docs/kernels.md``.
"""

from moeflow.kernels.dispatch import (
    BACKENDS,
    CPU_INT4,
    awq_linear,
    combine,
    expert_forward,
    moe_forward,
    pack_awq_linear,
    resolve_backend,
    route,
    uses_cpu_int4,
    uses_triton,
)
from moeflow.kernels.formats import ExpertFormat
from moeflow.kernels.pool import ExpertPool

__all__ = ["BACKENDS", "CPU_INT4", "ExpertFormat", "ExpertPool", "awq_linear", "combine", "expert_forward",
           "moe_forward", "pack_awq_linear", "resolve_backend", "route", "uses_cpu_int4", "uses_triton"]
