"""Routing in one launch (:mod:`moeflow.kernels.routing.plan`): softmax / top-k / renormalise of the router logits,
the sentinel fill and the align-block-size plan. References: :mod:`moeflow.kernels.experts.reference`.

Importing this package imports Triton; :mod:`moeflow.kernels.experts.ops` imports it where the kernel runs. Named
``routing``, not ``route``: importing a subpackage binds its name on ``moeflow.kernels``, which would replace
the public :func:`moeflow.kernels.route` (``tests/test_architecture.py`` checks every package for this).
"""

from moeflow.kernels.routing.plan import plan_blocks, route_plan

__all__ = ["plan_blocks", "route_plan"]
