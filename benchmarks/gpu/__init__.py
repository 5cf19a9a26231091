"""The GPU lane (run by ``benchmarks/run_all_gpu.sh`` and ``benchmarks/gpu_loan.sh``): kernels, offload, engine,
policies, families, serve, the loan's headline; each also runs on the CPU at ``--tiny`` / ``--dry-run`` sizes."""
