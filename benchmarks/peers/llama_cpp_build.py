"""Building llama.cpp's llama-bench and llama-quantize with CUDA on the lent GPU machine (the GPU lane's peers
stage, benchmarks/peers/run_gpu_peers.py) from the source subset of gpu_peer_sources.sh: the configure command,
what a toolkit with nvcc alone lacks (cuBLAS from torch's pip wheels, the driver's libcuda), the background
build, and the environment its binaries run in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def cmake_configure_command(src: str | Path, build: str | Path, cuda: bool = True, flash_attn: bool = False,
                            native: bool = True) -> list[str]:
    """The llama.cpp configure command of the peers stage: static, Release, only the tools' needs; with CUDA:
    sm_90 only, FlashAttention kernels off unless ``flash_attn`` (their instances are most of the CUDA build),
    no NCCL, no downloaded CCCL."""
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DBUILD_SHARED_LIBS=OFF", f"-DGGML_NATIVE={'ON' if native else 'OFF'}", "-DGGML_OPENMP=ON",
           "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON"]
    if not cuda:
        return cmd + ["-DGGML_CUDA=OFF"]
    cmd += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DGGML_CUDA_FA={'ON' if flash_attn else 'OFF'}",
            "-DGGML_CUDA_NCCL=OFF", "-DGGML_CUDA_CUB_3DOT2=OFF"]
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.isfile(p)), None)
    return cmd + ([f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else []) + cuda_library_flags(nvcc, Path(build))


def nvidia_wheel_dirs() -> list[Path]:
    """The ``nvidia/`` folders of pip's CUDA wheels (torch's own cuBLAS: headers and libraries) on sys.path, and
    $PEERS_NVIDIA_DIR."""
    extra = [Path(os.environ["PEERS_NVIDIA_DIR"])] if os.environ.get("PEERS_NVIDIA_DIR") else []
    return extra + [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]


def cuda_library_flags(nvcc: str | None, build: Path) -> list[str]:
    """CMake hints for what a CUDA toolkit with nvcc alone lacks: cuBLAS (taken from pip's nvidia wheels: its
    headers linked into ``build/cublas-include``, its libraries by path) and the driver's libcuda (no stub)."""
    toolkit = Path(os.path.realpath(nvcc)).parents[1] if nvcc else Path("/usr/local/cuda")
    if nvcc and Path(nvcc).read_bytes()[:2] == b"#!":  # a wrapper script (exec /usr/local/cuda-X/bin/nvcc)
        found = [w for w in Path(nvcc).read_text().split() if w.endswith("/bin/nvcc")]
        toolkit = Path(found[0]).parents[1] if found else toolkit
    libdirs = [toolkit / "lib64", toolkit / "lib", toolkit / "targets" / "x86_64-linux" / "lib"]
    flags = []
    if not any((d / "libcublas.so").exists() for d in libdirs):
        for root in nvidia_wheel_dirs():
            lib, lt = sorted(root.glob("*/lib/libcublas.so*")), sorted(root.glob("*/lib/libcublasLt.so*"))
            heads = sorted(root.glob("*/include/cublas_v2.h"))
            if lib and lt and heads:
                inc = build / "cublas-include"
                inc.mkdir(parents=True, exist_ok=True)
                for h in heads[0].parent.glob("cublas*.h"):
                    if not (inc / h.name).exists():
                        (inc / h.name).symlink_to(h)
                flags += [f"-DCUDA_cublas_LIBRARY={lib[0]}", f"-DCUDA_cublasLt_LIBRARY={lt[0]}",
                          f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
                break
    if not any((d / "stubs" / "libcuda.so").exists() or (d / "libcuda.so").exists() for d in libdirs):
        driver = next((p for p in ("/usr/lib/x86_64-linux-gnu/libcuda.so", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                                   "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib64/libcuda.so.1")
                       if os.path.exists(p)), None)
        if driver:
            flags.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
    return flags


def runtime_env() -> dict[str, str]:
    """The environment llama.cpp's binaries run in: pip's CUDA libraries on LD_LIBRARY_PATH (when cuBLAS came
    from there, see :func:`cuda_library_flags`)."""
    libs = [str(d) for root in nvidia_wheel_dirs() for d in sorted(root.glob("*/lib")) if any(d.glob("libcublas*"))]
    old = os.environ.get("LD_LIBRARY_PATH", "")
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(libs + ([old] if old else []))}


def start_build(src: Path, build: Path, flash_attn: bool, jobs: int, log: Path) -> subprocess.Popen | None:
    """Configure and start building llama-bench + llama-quantize with CUDA in the background (None: built)."""
    if (build / "bin" / "llama-bench").is_file() and (build / "bin" / "llama-quantize").is_file():
        return None
    if not (src / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"{src}: no llama.cpp sources; run benchmarks/peers/gpu_peer_sources.sh here and "
                                "carry .peers/llama.cpp")
    configure = " ".join(cmake_configure_command(src, build, cuda=True, flash_attn=flash_attn))
    script = f"{configure} && cmake --build {build} -j{jobs} --target llama-bench llama-quantize"
    return subprocess.Popen(["bash", "-c", script], stdout=log.open("w"), stderr=subprocess.STDOUT)
