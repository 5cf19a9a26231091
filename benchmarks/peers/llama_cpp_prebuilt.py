"""The prebuilt llama.cpp (CUDA sm_90 + CPU backends, ``shared/peers/llama-cpp-cuda-sm90.tar.xz``; its README says
how it was built) for the GPU lane and the tests: where the archive is, unpacking it once (cached by its sha256),
the environment its binaries run in (cuBLAS from torch's nvidia pip wheel on LD_LIBRARY_PATH, GCC 12's libstdc++
from ``compat/`` as a fallback), ``--list-devices`` and one ``llama-bench`` run parsed from its JSON.

    python -m benchmarks.peers.llama_cpp_prebuilt      # unpack, print the bin dir and --list-devices
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from benchmarks.peers.llama_cpp_build import runtime_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

ARCHIVE = "llama-cpp-cuda-sm90.tar.xz"
TOP = "llama-cpp-cuda-sm90"


def find_archive() -> Path | None:
    """$LLAMA_CPP_TARBALL, else the first of .peers/, shared/peers/ and ../shared/peers/ (beside the repository
    in CI) that holds the archive; None when there is none."""
    env = os.environ.get("LLAMA_CPP_TARBALL")
    candidates = [Path(env)] if env else []
    candidates += [REPO / ".peers" / ARCHIVE, REPO / "shared" / "peers" / ARCHIVE,
                   REPO.parent / "shared" / "peers" / ARCHIVE]
    return next((p for p in candidates if p.is_file()), None)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack(archive: Path, cache: Path | None = None) -> Path:
    """Unpack ``archive`` once into ``cache`` (default ~/.cache/moeflow, else the temp dir) under a folder named by
    its sha256; returns the ``bin`` directory (llama-bench and its libraries)."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moeflow"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "moeflow-cache"
        cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{TOP}-{_sha256(archive)[:12]}"
    bench = dest / TOP / "bin" / "llama-bench"
    if not bench.is_file():
        part = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(part, filter="tar")
        if not (part / TOP / "bin" / "llama-bench").is_file():
            raise FileNotFoundError(f"{archive}: no {TOP}/bin/llama-bench inside")
        try:
            part.rename(dest)
        except OSError:  # unpacked at the same time by another process: keep theirs
            shutil.rmtree(part, ignore_errors=True)
    return dest / TOP / "bin"


def run_env(bin_dir: Path, compat: bool = False) -> dict[str, str]:
    """The binaries' environment: cuBLAS of the nvidia pip wheels on LD_LIBRARY_PATH (``runtime_env``), and with
    ``compat`` the bundled libstdc++ (for a host whose own is older than GCC 12's)."""
    env = runtime_env()
    if compat:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(bin_dir.parent / "compat"),
                                                               env.get("LD_LIBRARY_PATH", "")]))
    return env


def list_devices(bin_dir: Path, timeout: float = 60) -> dict:
    """``llama-bench --list-devices``: the output, whether a CUDA device is listed, the LD_LIBRARY_PATH folder that
    holds libcublas (None: the CUDA backend cannot load), and whether the compat libstdc++ was needed (tried only when
    the plain run fails)."""
    out: dict = {}
    for compat in (False, True):
        done = subprocess.run([str(bin_dir / "llama-bench"), "--list-devices"], capture_output=True, text=True,
                              timeout=timeout, env=run_env(bin_dir, compat))
        out = {"rc": done.returncode, "output": (done.stdout + done.stderr)[-3000:], "compat_libstdcxx": compat,
               "ld_library_path": run_env(bin_dir, compat).get("LD_LIBRARY_PATH", "")}
        if done.returncode == 0:
            break
    out["cuda"] = "CUDA0" in out["output"]
    out["cuda_backend_loaded"] = "loaded CUDA backend" in out["output"]  # libggml-cuda.so resolved (cuBLAS found)
    # the CUDA backend loads silently or not at all: say whether cuBLAS was there to load
    out["cublas_dir"] = next((d for d in out["ld_library_path"].split(os.pathsep)
                              if d and any(Path(d).glob("libcublas.so*"))), None)
    return out


def llama_bench(bin_dir: Path, gguf: Path, *, ngl: int, n_cpu_moe: int, prompt: int, gen: int, reps: int,
                threads: int, timeout: float, compat: bool = False, extra: tuple[str, ...] = ()) -> dict:
    """One ``llama-bench -o json`` run: tok/s of pp<prompt> and tg<gen> (mean and std), with the build, backends
    and GPU it reports. RuntimeError with the end of its output when it fails."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", str(ngl), "--n-cpu-moe", str(n_cpu_moe),
           "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-t", str(threads), "-o", "json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env(bin_dir, compat))
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    res = {"command": " ".join(cmd[1:]), "build": rows[0].get("build_commit"), "backends": rows[0].get("backends"),
           "gpu": rows[0].get("gpu_info"), "cpu": rows[0].get("cpu_info"), "n_cpu_moe": n_cpu_moe, "ngl": ngl,
           "threads": threads, "model_bytes": rows[0].get("model_size")}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        res[key], res[key + "_std"] = r["avg_ts"], r["stddev_ts"]
    return res


if __name__ == "__main__":
    found = find_archive()
    if found is None:
        raise SystemExit(f"no {ARCHIVE}: set LLAMA_CPP_TARBALL or copy it to .peers/")
    bin_dir = unpack(found)
    print(bin_dir)
    print(json.dumps(list_devices(bin_dir), indent=1))
