"""The GPU lane's first step: print the Python stack and stop at once, naming what is missing, when a package or
a torch API the lane needs is absent (issue 12: a lent GPU's 30 minutes must not go to an ImportError).

The lent machine's stack differs from CI's (benchmarks/results/gpu_stack/README.md: Python 3.12, torch 2.11 CUDA
13, Triton 3.6, transformers 5.17; no fastapi/uvicorn/pydantic/openai, carried as wheels by gpu_wheels.sh).

    python -m benchmarks.gpu.stack            # versions; exit 1 when a needed package or torch API is missing
    python -m benchmarks.gpu.stack --cuda     # also exit 1 without a usable CUDA device (the real lane)
    python -m benchmarks.gpu.stack --pytest   # also need pytest (the correctness stage)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import sys

# import name -> what needs it; every one must import
NEEDED = {
    "torch": "everything", "triton": "the kernels", "numpy": "the offload scheduler", "safetensors": "checkpoints",
    "tokenizers": "tokenizers", "huggingface_hub": "model download", "tqdm": "loading", "jinja2": "chat templates",
}
# reported when present; their absence costs one step, not the stage
OPTIONAL = {
    "transformers": "peers and family tests", "accelerate": "peers", "pytest_timeout": "per-test time limit",
    "xdist": "pytest -n", "prometheus_client": "moeflow serve", "fastapi": "moeflow serve (gpu_wheels.sh)",
    "uvicorn": "moeflow serve (gpu_wheels.sh)", "pydantic": "moeflow serve (gpu_wheels.sh)",
    "openai": "serve client (optional)", "hypothesis": "CPU property tests",
    "gguf": "gpu_loan.sh's GGUF checkpoints and moeflow's GGUF loading (gpu_wheels.sh)",
    "llguidance": "moeflow serve's guided decoding (gpu_wheels.sh)", "sentencepiece": "the peers' tokenizer",
}
# attributes the GPU-only paths call (moeflow/offload/host_store.py, readback.py, transport.py,
# moeflow/engine/cuda_graphs.py, moeflow/kernels/experts/ops.py, tests/race_transport.py): present in torch >= 2.4
TORCH_APIS = (
    "cuda.Event", "cuda.Stream", "cuda.stream", "cuda.current_stream", "cuda.CUDAGraph", "cuda.graph",
    "cuda.graph_pool_handle", "cuda.is_current_stream_capturing", "cuda.cudart", "cuda._sleep", "cuda.mem_get_info",
    "library.custom_op", "library.register_fake", "compiler.disable", "compiler.is_compiling",
    "ops.aten._weight_int4pack_mm",
    "utils._python_dispatch._get_current_dispatch_mode",  # moeflow/kernels/custom_op.py (private)
)
# only a CUDA build has them (the last: moeflow/kernels/workspace.py's stream key, private)
CUDA_BUILD_APIS = ("_C._cudart.cudaHostRegister", "_C._cudart.cudaHostUnregister", "_C._cuda_getCurrentRawStream")
# the import name's distribution where it differs (for the version of a module without __version__)
DISTRIBUTIONS = {"pytest_timeout": "pytest-timeout", "xdist": "pytest-xdist", "prometheus_client": "prometheus-client"}


def _version(name: str, module) -> str:
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(DISTRIBUTIONS.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
    return str(version)


def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check(cuda: bool, need_pytest: bool) -> list[str]:
    """Print the stack; return the problems (empty: the lane can start)."""
    problems: list[str] = []
    print(f"python {platform.python_version()} ({sys.executable})")
    needed = dict(NEEDED, **({"pytest": "the correctness stage"} if need_pytest else {}))
    for name, why in {**needed, **OPTIONAL}.items():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install raising something else
            line = f"{name}: MISSING ({type(exc).__name__}: {exc}) - needed by {why}"
            if name in needed:
                problems.append(line)
            print(line)
        else:
            print(f"{name} {_version(name, module)}")
    try:
        import torch
    except Exception:
        return problems
    print(f"torch cuda {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
    apis = TORCH_APIS + (CUDA_BUILD_APIS if torch.version.cuda else ())
    problems += [f"torch.{api}: missing in torch {torch.__version__}" for api in apis if not _has(torch, api)]
    if cuda:
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a CPU build: the lane needs a CUDA build")
        if not torch.cuda.is_available():
            problems.append("no CUDA device visible to torch (nvidia-smi above; every cuda test would skip)")
        else:
            props = torch.cuda.get_device_properties(0)
            print(f"gpu {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB")
    try:
        importlib.import_module("triton.backends.nvidia")
    except Exception as exc:
        problems.append(f"triton.backends.nvidia: {type(exc).__name__}: {exc} (Triton cannot compile for CUDA)")
    try:
        importlib.import_module("moeflow")
    except Exception as exc:
        problems.append(f"import moeflow: {type(exc).__name__}: {exc}")
    return problems


def _has(torch_module, api: str) -> bool:
    try:
        _resolve(torch_module, api)
    except (AttributeError, RuntimeError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="need a CUDA device")
    p.add_argument("--pytest", action="store_true", help="need pytest (the correctness stage)")
    args = p.parse_args(argv)
    problems = check(args.cuda, args.pytest)
    if problems:
        print("STACK CHECK FAILED - the GPU lane would break on:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print("stack check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
