"""Test-wide set-up. TRITON_INTERPRET must be set before any module defining @triton.jit kernels is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
