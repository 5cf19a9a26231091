"""Machine-code reports of the Triton kernels, compiled for a GPU target on any machine (no GPU needed)."""
