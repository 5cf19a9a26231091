"""moeflow's own CPU kernels for quantized weights (``native.c``, the int4 kernel in ``q4.c``, the int8
one in ``q8.c``): int4 and int8 weights times int8 activations.

Why: torch's CPU kernels for quantized weights are compute-bound on AVX2 machines (``_weight_int4pack_mm_for_cpu``
reads 2.4 GB/s on one core of the 2-core AMD EPYC we benchmark on, ``_weight_int8pack_mm`` 3.4 GB/s, where a core
streams ~10-16 GB/s), so a decode step of a 4-bit model ran at a third of llama.cpp's speed. These kernels quantize
the activations to int8 per block of 32 features and multiply with integer dot products (AVX2 ``maddubs``), the
technique llama.cpp's Q4_0 x Q8_0 path uses, on moeflow's own formats (AWQ's asymmetric int4 groups as published).
The int4 rows are interleaved in groups of 8 (:class:`Q4Matrix`) so one multiply serves 8 rows and a tile of 4
tokens reuses each unpacked block: memory-bound up to ~4 tokens per call (issue 21, benchmarks/results/cpu_native).
The int8 rows likewise (:class:`Q8Matrix`, converted once at load; the stored checkpoint is not changed). An int4
matrix with fp16 scales (AWQ's) keeps them in fp16 with its uint8 zero points (``Q4_F16Z``, 7% fewer bytes per
call at group 128), the kernel forming the fp32 mins exactly: the same results as fp32 scales and mins.

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

Numerics (the fp32 models below: :func:`quantize_activations`, :func:`q4_reference`): activations rounded to
int8 with one scale per token and 32 features (max|x| / 127: relative error ~0.5% per element, averaging out in
a dot product), weights exact, integer products summed exactly per block, fp32 across blocks; fp32 in, fp32 out.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moeflow.kernels.cpu import hugepages
from moeflow.quant.awq import unpack_int4
from moeflow.user_cache import cache_dir

log = logging.getLogger(__name__)

# one library: the matrix kernels, the int4 and int8 row-group kernels, the decode-step ops
SOURCES = tuple(Path(__file__).with_name(f) for f in ("native.c", "q4.c", "q4z.c", "q8.c", "step.c", "step_region.c",
                                                     "step_gptoss.c",  # gpt-oss's one-call decode step
                                                     "step_head.c", "repack.c",
                                                     "gguf.c", "gguf_k.c",  # GGUF experts (kernels/cpu/gguf.py)
                                                     "mxfp4.c", "mxfp4_epilogue.c"))  # MXFP4 (mxfp4_native.py)
HEADERS = tuple(Path(__file__).with_name(f) for f in ("native.h", "gguf.h", "step.h", "mxfp4.h",  # in the digest
                                                     "mxfp4_pair.h"))
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


def _check(rc: int, what: str) -> None:
    if rc:
        raise MemoryError(f"{what}: the CPU kernel could not allocate its activation buffers")


def _fp32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()


Q4_F32, Q4_F16Z, Q4_F16Z8 = 0, 1, 2  # q4.c's forms of a q4 matrix's scales and mins (Q4Matrix.fmt)
Q4_0_GROUP = 32  # the one group size of the Q4_F16Z8 form (GGUF's Q4_0 block)


def q4_fmt(scales: torch.Tensor, mins: torch.Tensor) -> int:
    """The form (``Q4_F32``, ``Q4_F16Z``, ``Q4_F16Z8``) of a q4 matrix's scales and mins tensors."""
    if scales.dtype != torch.float16:
        return Q4_F32
    return Q4_F16Z if mins.numel() else Q4_F16Z8


@dataclass
class Q4Matrix:
    """A 4-bit matrix ``W [N, K]`` in this module's format: ``W = q * s + m`` per group of ``group_size`` inputs.

    Rows are interleaved in groups of 8 (``q4.c``'s layout: one integer multiply covers 8 rows x 4 features),
    the last ``N % 8`` rows stored plainly; each group's bytes are its rows' bytes of a ``[N, K/2]`` tensor, so a
    range of rows starting and ending at multiples of 8 (or at N) is still a slice of every tensor.

    Three forms (:attr:`fmt`): fp32 scales and mins (``Q4_F32``), or fp16 scales with the uint8 zero points held in
    ``mins``' place (``Q4_F16Z``, m = -zero * s formed in fp32 by the kernel): the same weights and the same
    results bit for bit, 3 instead of 8 bytes per row and group (-7% of the bytes a call reads at group 128).
    :meth:`from_awq` picks the second for fp16 scales (AWQ checkpoints', ``quantize_rtn``'s). The third,
    ``Q4_F16Z8``, is GGUF's Q4_0 (group 32, every zero point 8): fp16 scales and an empty ``mins`` (nothing
    stored or read for the zero points, 18 bytes per row and 32 inputs as in the file); :meth:`from_awq` picks it
    for group 32 with every zero point 8, :meth:`from_q4_0` makes it from the file's blocks. At group 32 the
    integer zero points (``Q4_F16Z``, ``Q4_F16Z8``) are folded into the integer block sums (q4.c), so both forms
    of the same weights give the same bits."""

    packed: torch.Tensor  # uint8 [N, K/2], row-grouped (see _group_rows)
    scales: torch.Tensor  # fp32 or fp16 [N, K/g], row-grouped
    mins: torch.Tensor  # fp32 [N, K/g] (= -zero * scale), or with fp16 scales uint8 zeros [N, K/g] (or uint8 [0]:
    # every zero point 8); row-grouped
    group_size: int

    @classmethod
    def from_q4_0(cls, codes: torch.Tensor, d: torch.Tensor) -> Q4Matrix:
        """GGUF Q4_0 rows as stored (:func:`moeflow.quant.ggml.q4_0_codes`): codes uint8 [N, K] in [0, 15], d fp16
        [N, K/32]; the weight ``(codes - 8) * d``, exactly, in the ``Q4_F16Z8`` form."""
        n, k = codes.shape
        if k % Q4_0_GROUP or tuple(d.shape) != (n, k // Q4_0_GROUP) or d.dtype != torch.float16:
            raise ValueError(f"Q4_0 codes {tuple(codes.shape)} / scales {d.dtype} {tuple(d.shape)}: expected codes "
                             f"[N, K] with K % 32 == 0 and fp16 scales [N, K/32]")
        return cls(_pack_q4(codes.to(torch.uint8)), _group_rows(d.contiguous()), torch.empty(0, dtype=torch.uint8),
                   Q4_0_GROUP)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 compact: bool | None = None, out: Q4Matrix | None = None) -> Q4Matrix:
        """AWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales [K/g, N] (y = x @ W_awq).
        ``compact`` (default: scales are fp16): the ``Q4_F16Z`` form; fp32 scales that are not fp16 numbers
        cannot take it. ``out``: a matrix of this shape and form (views of a host-store region) whose tensors are
        written in place, the packed weights converted straight into them; returned."""
        if group_size % BLOCK or qweight.shape[0] % group_size:
            raise ValueError(f"qweight {tuple(qweight.shape)}, group_size {group_size}: the CPU kernel needs "
                             f"group_size % {BLOCK} == 0 and in_features % group_size == 0")
        from moeflow.kernels.repack import awq_to_q4_packed

        # moves packed words: bit for bit _pack_q4 of the unpacked q^T
        packed = awq_to_q4_packed(qweight.cpu(), out=None if out is None else out.packed, lib=library())
        zeros = unpack_int4(qzeros.cpu())
        compact = scales.dtype == torch.float16 if compact is None else compact
        form = out is None  # (else the scales and mins are temporaries, copied into out's)
        if compact:
            half = scales.cpu().half()
            if not torch.equal(half.float(), scales.cpu().float()):
                raise ValueError("Q4Matrix.from_awq(compact=True): the scales are not all fp16 numbers")
            zero8 = group_size == Q4_0_GROUP and (out is None or out.fmt == Q4_F16Z8) and bool((zeros == 8).all())
            mins = torch.empty(0, dtype=torch.uint8) if zero8 else \
                _group_rows(zeros.to(torch.uint8).T.contiguous(), form=form)
            made = cls(packed, _group_rows(half.T.contiguous(), form=form), mins, group_size)
        else:
            s = scales.cpu().float()
            mins = -zeros.float() * s
            made = cls(packed, _group_rows(s.T.contiguous(), form=form), _group_rows(mins.T.contiguous(), form=form),
                       group_size)
        if out is None:
            return made
        if made.fmt != out.fmt or made.group_size != out.group_size:
            raise ValueError(f"Q4Matrix.from_awq(out=...): out is form {out.fmt} group {out.group_size}, the "
                             f"tensors give form {made.fmt} group {made.group_size}")
        out.scales.copy_(made.scales)
        out.mins.copy_(made.mins)
        return out

    @property
    def fmt(self) -> int:
        """``Q4_F16Z`` (fp16 scales, uint8 zeros), ``Q4_F16Z8`` (fp16 scales, zeros 8) or ``Q4_F32`` (fp32 scales
        and mins): the kernels' ``fmt``."""
        return q4_fmt(self.scales, self.mins)

    def fp32_form(self) -> Q4Matrix:
        """This matrix in the ``Q4_F32`` form (itself when it is): the same weights."""
        if self.fmt == Q4_F32:
            return self
        s = self.scales.float()
        zeros = self.mins.float() if self.fmt == Q4_F16Z else torch.full_like(s, 8.0)
        return Q4Matrix(self.packed, s, -zeros * s, self.group_size)

    @classmethod
    def concat_rows(cls, parts: list[Q4Matrix]) -> Q4Matrix:
        """One matrix whose rows are ``parts``' rows in order (e.g. q, k, v fused into one). Plain concatenation of
        the tensors where every part but the last has a multiple of 8 rows; else the rows are re-grouped. Parts
        of both forms: the result in the fp32 form."""
        if len({(p.shape[1], p.group_size) for p in parts}) != 1:
            raise ValueError(f"concat_rows: parts of shapes {[p.shape for p in parts]} and group sizes "
                             f"{[p.group_size for p in parts]}: in_features and group_size must agree")
        if len({p.fmt for p in parts}) > 1:
            # (the fp32 form's kernel at group 32 is not the integer-zero one: results of the parts change slightly)
            parts = [p.fp32_form() for p in parts]
        if all(p.shape[0] % ROW_GROUP == 0 for p in parts[:-1]):
            return cls(*(hugepages.cat([getattr(p, f) for p in parts]) for f in ("packed", "scales", "mins")),
                       parts[0].group_size)
        q = torch.cat([_unpack_q4(p.packed) for p in parts])
        s = torch.cat([_group_rows(p.scales, inverse=True) for p in parts])
        if parts[0].fmt == Q4_F16Z8:
            return cls(_pack_q4(q), _group_rows(s), parts[0].mins, parts[0].group_size)
        m = torch.cat([_group_rows(p.mins, inverse=True) for p in parts])
        return cls(_pack_q4(q), _group_rows(s), _group_rows(m), parts[0].group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, N] (``x @ W.T``)."""
        return q4_matmul(x, self.packed, self.scales, self.mins, self.group_size)

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K]: the weight the kernel multiplies by."""
        g, f = self.group_size, self.fp32_form()
        s, m = _group_rows(f.scales, inverse=True), _group_rows(f.mins, inverse=True)
        return _unpack_q4(self.packed).float() * s.repeat_interleave(g, 1) + m.repeat_interleave(g, 1)

    @property
    def nbytes(self) -> int:
        return q4_nbytes(self.packed, self.scales, self.mins)


def _group_rows(t: torch.Tensor, inverse: bool = False, form: bool = True) -> torch.Tensor:
    """Per-row values [N, C] (scales, mins) <-> the kernel's order: within each group of 8 rows, [C, 8]. ``form``:
    the kernel's order is a weight form to keep (on huge pages: :mod:`~moeflow.kernels.cpu.hugepages`), else a
    temporary."""
    n, c = t.shape
    whole = n - n % ROW_GROUP
    g = t[:whole].reshape(whole // ROW_GROUP, *((c, ROW_GROUP) if inverse else (ROW_GROUP, c)))
    parts = [g.transpose(1, 2).reshape(whole, c), t[whole:]]
    return hugepages.cat(parts) if form and not inverse else torch.cat(parts).contiguous()


def _pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in [0, 15] -> packed uint8 [N, K/2] in q4.c's layout."""
    n, k = q.shape
    whole = n - n % ROW_GROUP
    # grouped rows: [group, row r, block b, c, nibble h, j] (feature 32b + 8c + 4h + j) -> bytes [group, b, c, r, j]
    g = q[:whole].reshape(whole // ROW_GROUP, ROW_GROUP, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    grouped = (g[..., 0] | (g[..., 1] << 4)).reshape(whole, k // 2)
    tail = q[whole:].reshape(n - whole, k // BLOCK, 2, BLOCK // 2)  # plain rows: byte j = q[j] | q[16 + j] << 4
    return hugepages.cat([grouped, (tail[:, :, 0] | (tail[:, :, 1] << 4)).reshape(n - whole, k // 2)])


def _unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack_q4`: uint8 [N, K] in [0, 15]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    whole = n - n % ROW_GROUP
    nib = torch.stack([packed & 0xF, packed >> 4], -1)  # [N, K/2, 2]
    g = nib[:whole].reshape(whole // ROW_GROUP, k // BLOCK, 4, ROW_GROUP, 4, 2).permute(0, 3, 1, 2, 5, 4)
    tail = nib[whole:].reshape(n - whole, k // BLOCK, BLOCK // 2, 2).transpose(2, 3)
    return torch.cat([g.reshape(whole, k), tail.reshape(n - whole, k)])


@dataclass
class Q8Matrix:
    """An 8-bit matrix ``W [N, K] = q * s[:, None]`` (q int8 in [-127, 127], one fp32 scale per row) in
    ``q8.c``'s layout: rows interleaved in groups of 8 (one integer multiply covers 8 rows x 4 features), the
    last ``N % 8`` rows stored plainly. Each group's bytes are its rows' bytes of a ``[N, K]`` tensor and the
    scales stay in row order, so a range of rows starting and ending at multiples of 8 (or at N) is a slice."""

    weight: torch.Tensor  # int8 [N, K], row-grouped (see _group_q8)
    scales: torch.Tensor  # fp32 [N]

    @classmethod
    def from_rows(cls, q: torch.Tensor, scales: torch.Tensor) -> Q8Matrix:
        """From plain rows: q int8 [N, K] (K % 32 == 0), scales [N] (any float dtype; held in fp32)."""
        if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] % BLOCK:
            raise ValueError(f"int8 weight {q.dtype} {tuple(q.shape)}: the CPU kernel needs an int8 [out, in] "
                             f"matrix with in_features % {BLOCK} == 0")
        if tuple(scales.shape) != (q.shape[0],):
            raise ValueError(f"int8 scales {tuple(scales.shape)} for a weight {tuple(q.shape)}: expected one per row")
        return cls(_group_q8(q.cpu()), scales.detach().cpu().float().contiguous())

    @classmethod
    def concat_rows(cls, parts: list[Q8Matrix]) -> Q8Matrix:
        """One matrix whose rows are ``parts``' rows in order (as :meth:`Q4Matrix.concat_rows`)."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"concat_rows: parts of shapes {[p.shape for p in parts]}: in_features must agree")
        scales = torch.cat([p.scales for p in parts])
        if all(p.shape[0] % ROW_GROUP == 0 for p in parts[:-1]):
            return cls(hugepages.cat([p.weight for p in parts]), scales)
        return cls(_group_q8(torch.cat([_group_q8(p.weight, inverse=True) for p in parts])), scales)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scales.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, N] (``x @ W.T``)."""
        return q8_matmul(x, self.weight, self.scales)

    def matmul_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> fp32 [M, len(ids)]: ``matmul(x)[:, ids]`` for a few rows ids (int64 [n]),
        the same bits, reading only those rows (the int4 lm_head's recomputed candidates; one thread)."""
        n, k = self.weight.shape
        rows = _fp32_rows(x, k)
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n):
            raise IndexError(f"row ids {ids.tolist()} out of range for a q8 matrix of {n} rows")
        y = torch.empty((rows.shape[0], ids.numel()), dtype=torch.float32)
        _check(library().mf_q8_linear_rows(rows.data_ptr(), rows.shape[0], k, n, self.weight.data_ptr(),
                                           self.scales.data_ptr(), ids.data_ptr(), ids.numel(), y.data_ptr()),
               "q8 rows")
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 codes of rows ``ids`` (int64 [...]) in plain order: int8 [..., K] (an embedding lookup, a
        few rows recomputed) without ungrouping the matrix."""
        n, k = self.weight.shape
        whole = n - n % ROW_GROUP
        flat = ids.reshape(-1)
        grouped = self.weight[:whole].view(whole // ROW_GROUP, k // BLOCK, BLOCK // 4, ROW_GROUP, 4)
        if whole == n:
            out = grouped[flat // ROW_GROUP, :, :, flat % ROW_GROUP]
        else:
            out = torch.empty((flat.numel(), k), dtype=torch.int8)
            inside = flat < whole
            g = flat[inside]
            out[inside] = grouped[g // ROW_GROUP, :, :, g % ROW_GROUP].reshape(-1, k)
            out[~inside] = self.weight[flat[~inside]]
        return out.reshape(*ids.shape, k)

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K]: the weight the kernel multiplies by."""
        return _group_q8(self.weight, inverse=True).float() * self.scales[:, None]


def _group_q8(q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """int8 rows [N, K] <-> q8.c's layout: within each group of 8 rows, per 32-feature block b, bytes
    [c, r, j] = row r's feature 32b + 4c + j."""
    n, k = q.shape
    whole = n - n % ROW_GROUP
    shape = (k // BLOCK, BLOCK // 4, ROW_GROUP, 4) if inverse else (ROW_GROUP, k // BLOCK, BLOCK // 4, 4)
    order = (0, 3, 1, 2, 4) if inverse else (0, 2, 3, 1, 4)  # [group, b, c, r, j] <-> [group, r, b, c, j]
    g = q[:whole].reshape(whole // ROW_GROUP, *shape).permute(*order)
    if inverse:
        g = g.reshape(whole, k)  # a copy
        return g if whole == n else torch.cat([g, q[whole:]])
    out = hugepages.empty((n, k), q.dtype)  # the weight form: written once (a 600 MB lm_head), on huge pages
    out[:whole].view(g.shape).copy_(g)
    out[whole:] = q[whole:]
    return out


def q4_nbytes(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> int:
    """Bytes a q4 matrix's kernel call reads (its tensors, either form)."""
    return packed.numel() + scales.numel() * scales.element_size() + mins.numel() * mins.element_size()


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """:meth:`Q4Matrix.matmul` on the matrix's tensors (no object per call: the decode step's hot path)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = _fp32_rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32)
    fmt = q4_fmt(scales, mins)
    if fmt == Q4_F16Z8 and group_size != Q4_0_GROUP:
        raise ValueError(f"q4 matrix without zero points (Q4_F16Z8) needs group size 32, got {group_size}")
    _check(library().mf_q4_linear(rows.data_ptr(), rows.shape[0], k, n, group_size, fmt, packed.data_ptr(),
                                  scales.data_ptr(), mins.data_ptr(), y.data_ptr(), torch.get_num_threads()),
           "q4 linear")
    return y


def q8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:meth:`Q8Matrix.matmul` on the matrix's tensors: x [M, K] (any float dtype) @ (weight int8 [N, K],
    row-grouped, * scales fp32 [N, 1]).T -> fp32 [M, N]."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weight {tuple(weight.shape)}: the CPU kernel needs in_features % {BLOCK} == 0")
    rows = _fp32_rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32)
    _check(library().mf_q8_linear(rows.data_ptr(), rows.shape[0], k, n, weight.data_ptr(), scales.data_ptr(),
                                  y.data_ptr(), torch.get_num_threads()), "q8 linear")
    return y


def q4_expert(x: torch.Tensor, w13: Q4Matrix, w2: Q4Matrix, weights: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """One SwiGLU expert in one call: x fp32 [T, H], w13 [2I, H] (gate then up), w2 [H, I], routing weights
    fp32 [T] -> ``weights[:, None] * (silu(x W1.T) * (x W3.T)) W2.T``, fp32 [T, H]; added into ``out`` when given."""
    h = w2.shape[0]
    inter = w2.shape[1]
    rows = _fp32_rows(x, h)
    w = weights.to(torch.float32).contiguous()
    acc = out is not None
    if out is None:
        out = torch.empty((rows.shape[0], h), dtype=torch.float32)
    if w13.fmt != w2.fmt:
        w13, w2 = w13.fp32_form(), w2.fp32_form()
    _check(library().mf_q4_expert(
        rows.data_ptr(), rows.shape[0], h, inter, w13.group_size, w13.fmt, w13.packed.data_ptr(), w13.scales.data_ptr(),
        w13.mins.data_ptr(), w2.packed.data_ptr(), w2.scales.data_ptr(), w2.mins.data_ptr(), w.data_ptr(),
        out.data_ptr(), int(acc), torch.get_num_threads()), "q4 expert")
    return out


# ---- plain-torch fp32 models of the kernels (same rounding points; only the summation order differs) ----

def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K]: the values the kernels multiply by (int8 per 32-feature block, dequantized)."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def q4_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 model of :meth:`Q4Matrix.matmul` / :meth:`Q8Matrix.matmul` for the dequantized weight [N, K]."""
    return quantize_activations(x) @ weight.float().T


def q4_expert_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 model of :func:`q4_expert` for dequantized w13 [2I, H] and w2 [H, I]."""
    h = q4_reference(x, w13)
    inter = w2.shape[1]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    return q4_reference(a, w2) * weights.float()[:, None]
