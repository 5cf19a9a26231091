"""moeflow's own CPU kernels: C sources built into one library on first use, their ctypes bindings and the fp32
torch model of every function.

* ``native.h``: the header of the C sources (``gguf.h`` beside it for the GGUF ones); ``native.c`` (activation
  quantization, the linear and expert entry points), ``q4.c`` / ``q8.c`` (int4 / int8 row-group kernels),
  ``step.c`` (a decode step's glue), ``repack.c`` (load-time nibble transposes), ``gguf.c`` / ``gguf_k.c``
  (GGUF Q8_0 and K-quant experts as stored).
* :mod:`moeflow.kernels.cpu.gguf`: the GGUF experts' CPU form (``GGUFCpuExpert``) and its fp32 model.
* :mod:`moeflow.kernels.cpu.native`: the library's build (cached in ``$MOEFLOW_CACHE_DIR/cpu_native``), loading
  and signature declarations.
* :mod:`moeflow.kernels.cpu.q4_matrix` / :mod:`moeflow.kernels.cpu.q8_matrix`: the int4 / int8 matrix forms
  (:class:`Q4Matrix`, :class:`Q8Matrix`) and the kernel calls on them; :mod:`moeflow.kernels.cpu.matrix_reference`:
  their fp32 models.
* :mod:`moeflow.kernels.cpu.quant_linear`: int8 / int4 linear layers (``CpuQuantLinear``).
* :mod:`moeflow.kernels.cpu.lm_head`: the int4 lm_head with its top candidates recomputed in int8.
* :mod:`moeflow.kernels.cpu.step`: a decode step's glue (RMSNorm, attention, router, experts) as single calls.
* :mod:`moeflow.kernels.cpu.layers`: a one-token step through all decoder layers as one call.

Only the library and the matrix forms (``native``, ``q4_matrix``, ``q8_matrix``, ``matrix_reference``) are
re-exported: the other modules build on the CPU int4 expert format (``kernels/cpu/int4.py``), which itself imports
them; import those by their module path. Inside moeflow, import every name from the module that owns it.
"""

from moeflow.kernels.cpu.matrix_reference import q4_expert_reference, q4_reference, quantize_activations
from moeflow.kernels.cpu.native import ROW_GROUP, SIMD_NAMES, build, library, load, native_available, source_digest
from moeflow.kernels.cpu.q4_matrix import Q4_F16Z, Q4_F16Z8, Q4_F32, Q4Matrix, q4_expert
from moeflow.kernels.cpu.q8_matrix import Q8Matrix

__all__ = ["Q4_F16Z", "Q4_F16Z8", "Q4_F32", "ROW_GROUP", "SIMD_NAMES", "Q4Matrix", "Q8Matrix", "build", "library",
           "load",
           "native_available", "q4_expert", "q4_expert_reference", "q4_reference", "quantize_activations",
           "source_digest"]
