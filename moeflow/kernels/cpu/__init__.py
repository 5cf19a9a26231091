"""moeflow's own CPU kernels: C sources built into one library on first use, their ctypes bindings and the fp32
torch model of every function.

* ``native.h``: the header of the C sources (``gguf.h`` beside it for the GGUF ones); ``native.c`` (activation
  quantization, the linear and expert entry points), ``q4.c`` / ``q8.c`` (int4 / int8 row-group kernels),
  ``step.c`` (a decode step's glue), ``repack.c`` (load-time nibble transposes), ``gguf.c`` / ``gguf_k.c``
  (GGUF Q8_0 and K-quant experts as stored).
* :mod:`moeflow.kernels.cpu.gguf`: the GGUF experts' CPU form (``GGUFCpuExpert``) and its fp32 model.
* :mod:`moeflow.kernels.cpu.native`: the build (cached in ``$MOEFLOW_CACHE_DIR/cpu_native``), the bindings,
  :class:`Q4Matrix` / :class:`Q8Matrix` and the fp32 models; re-exported here.
* :mod:`moeflow.kernels.cpu.quant_linear`: int8 / int4 linear layers (``CpuQuantLinear``).
* :mod:`moeflow.kernels.cpu.lm_head`: the int4 lm_head with its top candidates recomputed in int8.
* :mod:`moeflow.kernels.cpu.step`: a decode step's glue (RMSNorm, attention, router, experts) as single calls.
* :mod:`moeflow.kernels.cpu.layers`: a one-token step through all decoder layers as one call.

Only :mod:`~moeflow.kernels.cpu.native` is re-exported: the other modules build on the CPU int4 expert format
(``kernels/cpu/int4.py``), which itself imports ``native``; import them by their module path.
"""

from moeflow.kernels.cpu.native import (
    Q4_F16Z,
    Q4_F16Z8,
    Q4_F32,
    ROW_GROUP,
    SIMD_NAMES,
    Q4Matrix,
    Q8Matrix,
    build,
    library,
    load,
    native_available,
    q4_expert,
    q4_expert_reference,
    q4_reference,
    quantize_activations,
    source_digest,
)

__all__ = ["Q4_F16Z", "Q4_F16Z8", "Q4_F32", "ROW_GROUP", "SIMD_NAMES", "Q4Matrix", "Q8Matrix", "build", "library",
           "load",
           "native_available", "q4_expert", "q4_expert_reference", "q4_reference", "quantize_activations",
           "source_digest"]
