"""The expert kernels: the grouped Triton GEMM with its split-K fixup (``gemm``), the combine (``combine``), the packed
AWQ linear (``linear``), MXFP4 (``mxfp4``, ``mxfp4_reference``), the biased epilogues (``biased``), the torch
references (``reference``), the CUDA-graph static form (``capturable``), the custom ops and eager launchers
(``ops``), argument checks (``checks``) and the tuned config tables (``configs``). Entry points:
:mod:`moeflow.kernels.dispatch` (re-exported by :mod:`moeflow.kernels`)."""
