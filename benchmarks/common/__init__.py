"""What several benchmarks share: the synthetic checkpoint writers (Mixtral AWQ, the other families, GGUF Q4_0)
and the GPU lane's pytest plugin."""
