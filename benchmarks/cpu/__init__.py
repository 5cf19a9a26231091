"""CPU kernels and CPU decode: int4 / MXFP4 experts, quantized linear layers, 16-bit attention, ``compile=True``."""
