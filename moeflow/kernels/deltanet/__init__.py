"""The Gated DeltaNet's kernels (Qwen3-Next, Qwen3.5-MoE); the fp32 torch references are
:mod:`moeflow.families.gated_deltanet`'s.

* :mod:`moeflow.kernels.deltanet.ops`: the launch paths (eager, or ``torch.ops.moeflow.gdn_*`` while
  ``torch.compile`` traces); importing it imports no Triton.
* :mod:`moeflow.kernels.deltanet.kernels`: the Triton kernels (decode conv + SiLU, the fused recurrence).
"""

from moeflow.kernels.deltanet.ops import conv_decode, recurrent

__all__ = ["conv_decode", "recurrent"]
