"""Building, loading and declaring moeflow's own CPU library: one shared object compiled from the C sources
beside this file (``native.c``, the int4 kernel in ``q4.c`` / ``q4z.c``, the int8 one in ``q8.c``, the decode-step
ops, the load-time repacks, the GGUF and MXFP4 kernels). The matrix forms its kernels multiply are
:mod:`~moeflow.kernels.cpu.q4_matrix` (int4) and :mod:`~moeflow.kernels.cpu.q8_matrix` (int8), their fp32 models
:mod:`~moeflow.kernels.cpu.matrix_reference`; the other binding modules (``step``, ``layers``, ``gguf``,
``mxfp4_native``) declare their functions' signatures through :func:`declared` / :func:`declared_library`.

Why: torch's CPU kernels for quantized weights are compute-bound on AVX2 machines (``_weight_int4pack_mm_for_cpu``
reads 2.4 GB/s on one core of the 2-core AMD EPYC we benchmark on, ``_weight_int8pack_mm`` 3.4 GB/s, where a core
streams ~10-16 GB/s), so a decode step of a 4-bit model ran at a third of llama.cpp's speed. These kernels quantize
the activations to int8 per block of 32 features (:data:`BLOCK`) and multiply with integer dot products (AVX2
``maddubs``), the technique llama.cpp's Q4_0 x Q8_0 path uses, on moeflow's own formats (AWQ's asymmetric int4
groups as published), with rows interleaved in groups of 8 (:data:`ROW_GROUP`).

Build: compiled on first use with the system C compiler (``$CC``, else ``gcc``/``cc``; ``-O3 -march=native
-fopenmp``) into ``cpu_native`` under :func:`moeflow.user_cache.cache_dir` (``$MOEFLOW_CACHE_DIR``), keyed by the
sources, the compiler, its flags and the CPU's flags (a cached build is never reused on another CPU); about a
second. The kernels are chosen at compile time from the CPU's own flags: AVX-512 VNNI (``vpdpbusd``, 16 rows per
register) where ``-march=native`` enables it, else AVX2 (``maddubs``), else portable C; ``MOEFLOW_CPU_ISA=avx2``
builds the AVX2 path on an AVX-512 machine. The AVX-512 and AVX2 kernels give the same bits (the same integer block
sums, the same fp32 operations per row; tests/test_cpu_isa.py). Without a compiler (or with
``MOEFLOW_CPU_NATIVE=0``) :func:`native_available` is False and the callers keep torch's kernels. OpenMP threads:
torch's count (``torch.get_num_threads()``), in the libgomp torch already loaded (same soname), so both share one
pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from moeflow.user_cache import cache_dir

log = logging.getLogger(__name__)

# one library: the matrix kernels, the int4 and int8 row-group kernels, the decode-step ops
SOURCES = tuple(Path(__file__).with_name(f) for f in ("native.c", "q4.c", "q4z.c", "q8.c", "step.c", "step_region.c",
                                                     "step_gptoss.c",  # gpt-oss's one-call decode step
                                                     "step_head.c", "step_loop.c",  # the greedy multi-token loop
                                                     "repack.c",
                                                     "gguf.c", "gguf_k.c", "gguf_q4kx8.c",  # GGUF experts (gguf.py)
                                                     "mxfp4.c", "mxfp4_epilogue.c"))  # MXFP4 (mxfp4_native.py)
HEADERS = tuple(Path(__file__).with_name(f) for f in ("native.h", "gguf.h", "gguf_kblock.h", "step.h", "mxfp4.h",
                                                     "mxfp4_pair.h"))  # in the digest
BLOCK = 32  # activation features per int8 scale (and the weights' packing block)
ROW_GROUP = 8  # q4 and q8 rows interleaved together (q4.c's and q8.c's layouts)
_LIB: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def _cpu_flags() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return platform.processor()


def source_digest() -> str:
    """A short hash of the kernels' C sources: names the kernel revision (cost-model calibrations are keyed by it)."""
    return hashlib.sha256("\0".join(f.read_text() for f in (*SOURCES, *HEADERS)).encode()).hexdigest()[:12]


ISAS = ("native", "avx2", "baseline")  # build(isa=...), MOEFLOW_CPU_ISA
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"], "baseline": []}
SIMD_NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}  # mf_simd()'s answers


def build(cache: Path, native_arch: bool = True, isa: str | None = None) -> Path:
    """Compile ``SOURCES`` (``native.c``, ``q4.c``, ``q4z.c``, ``q8.c``, ``step.c``, ``repack.c``) into one library in
    ``cache`` (once per source, compiler, flags and CPU); returns the library's path.
    ``isa`` (default ``$MOEFLOW_CPU_ISA``, else "native"): "native" (``-march=native``: the AVX-512 VNNI
    kernels where the CPU has them, else AVX2), "avx2" (the same without AVX-512: the path of an AVX2-only
    machine, testable on an AVX-512 one) or "baseline" (the portable C loops; tests use it).
    ``native_arch=False`` is ``isa="baseline"``."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    isa = isa or ("baseline" if not native_arch else os.environ.get("MOEFLOW_CPU_ISA", "native"))
    if isa not in ISAS:
        raise ValueError(f"MOEFLOW_CPU_ISA / isa={isa!r}: expected one of {', '.join(ISAS)}")
    arch = ISA_FLAGS[isa]
    flags = ["-O3", *arch, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # no implicit FMA: as the reference
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source_digest(), cc, version, *flags, _cpu_flags(), platform.machine()])
                         .encode()).hexdigest()[:16]
    lib = cache / f"libmoeflow_cpu_{key}.so"
    if not lib.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        res = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"{cc} could not build {', '.join(f.name for f in SOURCES)}:\n{res.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: concurrent builders each write their own temporary file
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernels (built on first call), or None where they cannot be built here."""
    global _LIB
    if _LIB is False:
        _LIB = None
        if os.environ.get("MOEFLOW_CPU_NATIVE", "1") != "0":
            cache = cache_dir() / "cpu_native"
            try:
                _LIB = load(build(cache))
            except (OSError, RuntimeError) as e:
                log.warning("moeflow's CPU kernels are unavailable (%s); using torch's int4/int8 kernels", e)
    return _LIB


def native_available() -> bool:
    """Whether moeflow's CPU kernels are built and loaded here (see the module docstring)."""
    return library() is not None


# per loaded library, the signature declarations of the other binding modules already run on it; held weakly: a
# later library could reuse a freed one's id() and would then run without its signatures
_DECLARED: weakref.WeakKeyDictionary[ctypes.CDLL, set[Callable[[ctypes.CDLL], None]]] = weakref.WeakKeyDictionary()


def declared(lib: ctypes.CDLL, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """``lib`` once ``declare(lib)`` (a binding module's function signatures) has run on it: once per library."""
    done = _DECLARED.setdefault(lib, set())
    if declare not in done:
        declare(lib)
        done.add(declare)
    return lib


def declared_library(declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL:
    """The library with ``declare``'s signatures (:func:`declared`); a RuntimeError ending in ``what`` (what cannot
    run) where the kernels do not build here."""
    lib = library()
    if lib is None:
        raise RuntimeError("moeflow's CPU kernels are unavailable here (no C compiler, or MOEFLOW_CPU_NATIVE=0): "
                           + what)
    return declared(lib, declare)


def check_rc(rc: int, what: str) -> None:
    """A kernel entry point's return code: -1 could not allocate (MemoryError), any other non-zero refused its
    arguments (ValueError naming the code)."""
    if rc == -1:
        raise MemoryError(f"{what}: the CPU kernel could not allocate its activation buffers")
    if rc:
        raise ValueError(f"{what}: the CPU kernel refused its arguments (code {rc})")


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' signatures declared."""
    return _declare(ctypes.CDLL(str(path)))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mf_q4_linear.argtypes = [p, i, i, i, i, i, p, p, p, p, i]
    lib.mf_q8_linear.argtypes = [p, i, i, i, p, p, p, i]
    lib.mf_q8_linear_rows.argtypes = [p, i, i, i, p, p, p, i, p]
    lib.mf_q4_expert.argtypes = [p, i, i, i, i, i, p, p, p, p, p, p, p, p, i, i]
    lib.mf_nibble_transpose.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, p, p]
    lib.mf_nibble_transpose.restype = None
    lib.mf_nibble_transpose_grouped.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, ctypes.c_int64, p]
    lib.mf_nibble_transpose_grouped.restype = None
    lib.mf_permute_word_bits.argtypes = [p, ctypes.c_int64, p, p, p]
    lib.mf_permute_word_bits.restype = None
    lib.mf_q4_0_to_awq.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, ctypes.c_int64, p, ctypes.c_int64]
    lib.mf_q4_0_to_awq.restype = None
    lib.mf_q4_0_to_q4z.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p]
    lib.mf_q4_0_to_q4z.restype = None
    lib.mf_quantize_rows_int8.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p]
    lib.mf_quantize_rows_int8.restype = None
    for f in (lib.mf_q4_linear, lib.mf_q8_linear, lib.mf_q8_linear_rows, lib.mf_q4_expert):
        f.restype = i
    return lib


def set_library(lib: Any) -> Any:
    """Make ``lib`` the library every binding calls (a build for another ISA, a wrapper that counts or times the
    calls; None: unavailable) in place of :func:`library`'s own; returns the one it replaces (restore it with this
    function). ``lib`` must carry the signatures :func:`load` declares."""
    global _LIB
    previous, _LIB = _LIB, lib
    return previous


@contextmanager
def using_library(lib: Any) -> Iterator[Any]:
    """:func:`set_library` for the ``with`` block only: the previous library is restored when it ends."""
    previous = set_library(lib)
    try:
        yield lib
    finally:
        set_library(previous)


def check_alloc(rc: int, what: str) -> None:
    """A matrix kernel's return code (``mf_q4_linear``, ``mf_q8_linear``, ...): non-zero could not allocate its
    activation buffers (MemoryError)."""
    if rc:
        raise MemoryError(f"{what}: the CPU kernel could not allocate its activation buffers")


def fp32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] (any float dtype) -> the contiguous fp32 rows [M, K] a kernel reads (``x`` itself when it is)."""
    rows = x.reshape(-1, k)
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
