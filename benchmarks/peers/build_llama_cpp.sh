#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize (CPU backend only) from the llama.cpp vendored in the
# llama-cpp-python source distribution on PyPI (the only network this project's machines may reach).
# Usage: benchmarks/peers/build_llama_cpp.sh WORKDIR   -> WORKDIR/llama.cpp/build/bin/{llama-bench,llama-quantize}
# A few minutes on 2 cores (-j2). Re-running reuses what is already there.
set -euo pipefail
work=${1:?usage: build_llama_cpp.sh WORKDIR}
mkdir -p "$work" && cd "$work"
if [ ! -d llama.cpp ]; then
    python -m pip download --no-binary :all: --no-deps llama-cpp-python -d sdist
    tar xzf sdist/llama_cpp_python-*.tar.gz
    mv llama_cpp_python-*/vendor/llama.cpp llama.cpp
    ls -d llama_cpp_python-* | sed 's/^llama_cpp_python-//' > llama.cpp/LLAMA_CPP_PYTHON_VERSION
fi
cd llama.cpp
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF \
    -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build build -j2 --target llama-bench llama-quantize
ls -la build/bin/llama-bench build/bin/llama-quantize
