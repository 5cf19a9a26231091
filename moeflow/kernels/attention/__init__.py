"""Decode attention read in place from the server's caches: Triton kernels, each module with its fp32 torch reference.

* :mod:`moeflow.kernels.attention.slot`: one query token per row over the slotted KV cache (GQA, windows, sinks).
* :mod:`moeflow.kernels.attention.latent`: MLA's absorbed attention over the latent cache (DSA's top-k as a mask).

Importing this package imports Triton; callers import it where a kernel runs (``engine/kv_slots.py``).
"""

from moeflow.kernels.attention.latent import latent_attention, latent_attention_reference
from moeflow.kernels.attention.slot import slot_attention, slot_attention_reference

__all__ = ["latent_attention", "latent_attention_reference", "slot_attention", "slot_attention_reference"]
