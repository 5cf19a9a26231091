"""A pool of expert slots on one device (:class:`ExpertPool`, defined beside the format contract in
:mod:`moeflow.kernels.formats.layout`), and the row-major copy of an AWQ pool for the layout timing."""

from __future__ import annotations

import copy

from moeflow.kernels.formats.layout import ExpertPool
from moeflow.kernels.formats.plain_layout import awq_panel, qweight_rows, rows_as_panels

__all__ = ["ExpertPool", "row_major_pool"]


def row_major_pool(pool: ExpertPool) -> ExpertPool:
    """The same AWQ experts with both qweights copied into the former row-major layout ``[S, N, K/8]`` and viewed
    as panels (:func:`rows_as_panels`): what the kernels read through strides for the side-by-side timing of the
    two layouts (the MXFP4 twin: :func:`moeflow.kernels.experts.mxfp4.row_major_copy`). Marked checked: its row
    stride is not the panel layout's, which the pool checks would refuse."""
    alt = copy.copy(pool)
    alt.tensors = dict(pool.tensors)
    for name in ("w13_qweight", "w2_qweight"):
        alt.tensors[name] = rows_as_panels(qweight_rows(pool.tensors[name]), awq_panel(pool.fmt.group_size))
    alt.checked = True
    return alt
