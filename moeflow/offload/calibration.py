"""Start-up calibration of the cost model's rates, cached on disk per machine, model shape and torch version.

Measured once (well under a second at tiny shapes, a few seconds at Mixtral's):

* host->device: copies of one expert region from the host store into a device slot (the path the copy
  engine takes; on a CPU "device" this is a memory copy);
* CPU: one expert in its CPU form (for AWQ the int4 format ``Int4Expert`` picks: moeflow's own kernels where they
  build, else torch's; for MXFP4 the native kernel on the stored blocks, :mod:`moeflow.kernels.cpu.mxfp4_native`,
  else the two-digit int4 form of :mod:`moeflow.kernels.cpu.mxfp4`) at 1, 8 and 16 tokens, on a worker of the CPU
  pool: the cost per further token is the slope from 8 to 16, and the tokens that cost nothing extra
  (``Rates.cpu_free_tokens``) are where that line meets the one-token cost - moeflow's int4 kernel is memory-bound
  up to ~3 tokens and compute-bound beyond (benchmarks/results/cpu_native/README.md), torch's is compute-bound from
  the second token. The key holds the expert kind and the CPU kernel (for moeflow's own, the hash of its C sources),
  so rates are cached apart and a changed kernel is timed again.

The cache file holds the key it was measured under. A file whose key differs (another machine, another
model shape, another torch, another device) is refused with a message saying what differs, and the
rates are measured again and written over it. Rates given in ``OffloadConfig`` replace measured ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from moeflow.kernels.cpu.int4 import cpu_expert_kernel
from moeflow.kernels.formats import ExpertFormat
from moeflow.offload.cost_model import Rates
from moeflow.user_cache import cache_dir

FORMAT_VERSION = 2  # 2: rates hold cpu_free_tokens
CPU_TOKENS = (8, 16)  # where the CPU cost per further token is measured (besides one token)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(
    fmt: ExpertFormat, device: torch.device, *, transport: str, pinned: bool, workers: int
) -> dict:
    """What the rates depend on; a cached file is used only when its key is equal."""
    device = torch.device(device)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "version": FORMAT_VERSION,
        "machine": platform.node(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernel": cpu_expert_kernel(),
        "torch": torch.__version__,
        "device": dev,
        "transport": transport,
        "pinned": bool(pinned),
        "cpu_workers": workers,
        "model": {"kind": fmt.kind, "hidden": fmt.hidden_size, "intermediate": fmt.intermediate_size,
                  "group": fmt.group_size, "dtype": str(fmt.dtype).removeprefix("torch."), "bytes": fmt.nbytes},
    }


def cache_path(key: dict, configured: str | os.PathLike | None = None) -> Path:
    """``configured``, else ``$MOEFLOW_CACHE_DIR`` (or ``~/.cache/moeflow``) / calibration-<hash of key>.json."""
    if configured is not None:
        return Path(configured)
    root = cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"calibration-{digest}.json"


def _differences(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    out = []
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name), ours.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"{prefix}{name} {a!r} (here: {b!r})")
    return out


def load_rates(path: Path, key: dict) -> Rates | None:
    """Rates from ``path`` if it exists and was measured under ``key``; None (with a warning saying why) if not."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        theirs, r = data["key"], data["rates"]
        rates = Rates(float(r["h2d_bytes_per_s"]), float(r["cpu_expert_s"]), float(r["cpu_token_s"]),
                      float(r["cpu_free_tokens"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"moeflow: ignoring unreadable calibration file {path} ({type(exc).__name__}: {exc}); "
                      "measuring the rates again", RuntimeWarning, stacklevel=3)
        return None
    diff = _differences(theirs, key)
    if diff:
        warnings.warn(
            f"moeflow: refusing calibration file {path}: it was measured for another machine or model "
            f"({'; '.join(diff)}). Measuring the rates on this one and overwriting it.",
            RuntimeWarning, stacklevel=3,
        )
        return None
    return rates


def save_rates(path: Path, key: dict, rates: Rates) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "rates": rates.as_dict(),
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
        os.replace(tmp, path)  # atomic: two processes calibrating at once never leave half a file
    except OSError as exc:  # a read-only home must not stop inference
        warnings.warn(f"moeflow: could not write calibration cache {path}: {exc}", RuntimeWarning, stacklevel=3)


def _best(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    return statistics.median(fn() for _ in range(reps))


def measure_h2d(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` (a host region into a device slot)."""
    cuda = dst.device.type == "cuda"

    def once() -> float:
        if cuda:
            torch.cuda.synchronize(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(dst.device)
        return time.perf_counter() - t0

    return src.numel() * src.element_size() / max(_best(once, reps), 1e-9)


def measure_cpu(expert, hidden: int, run: Callable[[Callable[[], float]], float],
                reps: int = 3) -> tuple[float, float, float]:
    """(seconds for one token, seconds per further token, tokens free under the one-token cost) of an expert's
    CPU form (``Int4Expert``, ``Mxfp4CpuExpert``); ``run`` executes a timing function on a CPU worker thread and
    returns its result."""
    lo, hi = CPU_TOKENS
    x = torch.randn(hi, hidden, generator=torch.Generator().manual_seed(0))
    w = torch.ones(hi)

    def timed(n: int) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            expert.forward(x[:n], w[:n])
            return time.perf_counter() - t0
        return once

    one, mid, many = (run(lambda n=n: _best(timed(n), reps)) for n in (1, lo, hi))
    per_token = (many - mid) / (hi - lo)
    if per_token <= 1e-6 * one:  # no measurable cost per token (free tokens would be meaningless)
        return one, 0.0, 1.0
    # the line through (lo, mid) with that slope meets the one-token cost at 1 + free tokens
    free = min(float(lo), max(1.0, lo - (mid - one) / per_token))
    return one, per_token, free


def resolve_rates(config, key: dict, measure: Callable[[], Rates]) -> tuple[Rates, str]:
    """The cost model's rates: ``OffloadConfig`` overrides, else the cache, else ``measure()`` (then cached).

    Returns (rates, source) with source "config", "cache <path>" or "measured <path>".
    """
    given = (config.h2d_gbps, config.cpu_expert_ms, config.cpu_token_ms)
    if all(v is not None for v in given):
        return Rates(config.h2d_gbps * 1e9, config.cpu_expert_ms / 1e3, config.cpu_token_ms / 1e3), "config"
    path = cache_path(key, config.calibration_file)
    rates = load_rates(path, key)
    source = f"cache {path}"
    if rates is None:
        rates = measure()
        save_rates(path, key, rates)
        source = f"measured {path}"
    return Rates(
        config.h2d_gbps * 1e9 if config.h2d_gbps is not None else rates.h2d_bytes_per_s,
        config.cpu_expert_ms / 1e3 if config.cpu_expert_ms is not None else rates.cpu_expert_s,
        config.cpu_token_ms / 1e3 if config.cpu_token_ms is not None else rates.cpu_token_s,
        1.0 if config.cpu_token_ms is not None else rates.cpu_free_tokens,  # a configured rate: every further token
    ), source
