#!/usr/bin/env bash
# The llama.cpp sources the GPU lane's `peers` stage builds on the lent machine (which has no network): the
# smallest subset of the llama.cpp vendored in the llama-cpp-python sdist that configures and builds
# `llama-bench` and `llama-quantize` with -DGGML_CUDA=ON (CPU + CUDA backends only), plus the GGUF converter
# (convert_hf_to_gguf.py, its conversion/ package and gguf-py). Run here (PyPI reachable), from any directory:
#
#   bash benchmarks/peers/gpu_peer_sources.sh      # -> .peers/llama.cpp (git-ignored, ~16 MiB), then
#   run(command="bash benchmarks/run_all_gpu.sh peers", carry=[".peers/llama.cpp"], timeout_s=600)
#
# Source: $LLAMA_CPP_SRC (a llama.cpp tree, e.g. the /tmp/peers/llama.cpp of build_llama_cpp.sh) when set and
# present, else the llama-cpp-python sdist ($LLAMA_CPP_PYTHON, default 0.3.36: the CPU peers' version) from PyPI.
# What is left out: docs, models, tests, examples, the server, its web UI and mtmd, every ggml backend but CPU
# and CUDA. tools/CMakeLists.txt is replaced by one that adds only
# llama-bench and quantize (the original adds every tool). CHECK=1 (default) then configures the subset here with
# CUDA on (configure only: no CUDA compile on this 2-core machine) and with CUDA off, and runs the compiler's -MM
# over every C/C++ source of the CPU build (every #include found), so a missing file fails here.
set -euo pipefail
cd "$(dirname "$0")/../.."
extracted=
dest=.peers/llama.cpp
src="${LLAMA_CPP_SRC:-/tmp/peers/llama.cpp}"
if [ ! -f "$src/CMakeLists.txt" ]; then  # the sdist (kept in .peers/sdist; its extracted tree is removed at the end)
  mkdir -p .peers/sdist
  ls .peers/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==${LLAMA_CPP_PYTHON:-0.3.36}" \
      -d .peers/sdist
  tarball=$(ls .peers/sdist/llama_cpp_python-*.tar.gz | tail -1)
  tar xzf "$tarball" -C .peers/sdist
  version=$(basename "$tarball" .tar.gz | sed 's/^llama_cpp_python-//')
  src=.peers/sdist/llama_cpp_python-$version/vendor/llama.cpp
  echo "$version" > "$src/LLAMA_CPP_PYTHON_VERSION"
  extracted=.peers/sdist/llama_cpp_python-$version
  trap 'rm -rf "$extracted"' EXIT
fi
rm -rf "$dest" && mkdir -p "$dest"
# top-level files (CMake, licence, the converter) and the directories the build and the converter read
for f in CMakeLists.txt LICENSE LLAMA_CPP_PYTHON_VERSION convert_hf_to_gguf.py; do
  [ -f "$src/$f" ] && cp "$src/$f" "$dest/"
done
for d in cmake common conversion gguf-py include licenses src vendor; do
  cp -r "$src/$d" "$dest/"
done
mkdir -p "$dest/ggml/src" "$dest/tools"
cp -r "$src/ggml/CMakeLists.txt" "$src/ggml/cmake" "$src/ggml/include" "$dest/ggml/"
# ggml/src: its own files plus the CPU and CUDA backends (the others are added only when their option is on)
find "$src/ggml/src" -maxdepth 1 -type f -exec cp {} "$dest/ggml/src/" \;
cp -r "$src/ggml/src/ggml-cpu" "$src/ggml/src/ggml-cuda" "$dest/ggml/src/"
cp -r "$src/tools/llama-bench" "$src/tools/quantize" "$dest/tools/"
cat > "$dest/tools/CMakeLists.txt" <<'EOF'
# moeflow's subset (benchmarks/peers/gpu_peer_sources.sh): only the two tools the GPU lane's peers stage runs
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
add_subdirectory(quantize)
EOF
find "$dest" \( -name '__pycache__' -o -name '*.md' -o -name '.git*' \) -prune -exec rm -rf {} +
echo "$dest: $(du -sh "$dest" | cut -f1) ($(find "$dest" -type f | wc -l) files) from $src"

[ "${CHECK:-1}" = 1 ] || exit 0
# the flags the device build uses (benchmarks/peers/llama_cpp_build.py), configure only
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" ${extracted:+"$extracted"}' EXIT
python3 - "$dest" "$tmp" <<'EOF'
import json, shlex, subprocess, sys
from benchmarks.peers.llama_cpp_build import cmake_configure_command  # `python3 -` puts the cwd, the repo, first

src, tmp = sys.argv[1], sys.argv[2]
for cuda in (True, False):
    cmd = cmake_configure_command(src, f"{tmp}/build-{'cuda' if cuda else 'cpu'}", cuda=cuda)
    done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    errors = [ln for ln in log.splitlines() if ln.startswith("CMake Error")]
    # this machine's CUDA toolkit has nvcc and cudart but no cuBLAS and no driver: every source and CMake file
    # was found ("Configuring done"); only the generate step misses the libraries (the lent machine has the
    # driver, and cuBLAS in torch's pip wheels: llama_cpp_build.cuda_library_flags)
    no_cublas = cuda and "-- Configuring done" in log and errors \
        and ("CUDA::cublas" in log or "CUDA::cuda_driver" in log) \
        and all("ggml-cuda/CMakeLists.txt" in e and "target_link_libraries" in e for e in errors)
    if done.returncode and not no_cublas:
        sys.exit(f"configure (cuda={cuda}) failed:\n{log[-2500:]}")
    note = " (generate step: no cuBLAS / libcuda on this machine)" if done.returncode else ""
    print(f"configure (cuda={cuda}) ok{note}:", " ".join(cmd[3:]))

# every C/C++ source of the CPU build resolves its #includes: the compiler's -MM (dependencies only, ~10 s)
# over the compile database; no object is compiled (the lent machine builds them, with CUDA)
build = f"{tmp}/build-cpu"
subprocess.run(["cmake", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", build], capture_output=True, check=True)
entries = json.load(open(f"{build}/compile_commands.json"))
for e in entries:
    args, keep, skip = shlex.split(e["command"]), [], False
    for a in args:
        if skip or a in ("-o", "-MF", "-MT"):
            skip = not skip
            continue
        if a not in ("-c", "-MD"):
            keep.append(a)
    done = subprocess.run(keep + ["-MM"], cwd=e["directory"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{e['file']}: its includes do not resolve in the subset:\n{done.stderr[-1500:]}")
print(f"{len(entries)} C/C++ sources of the CPU build: every #include found")
EOF
