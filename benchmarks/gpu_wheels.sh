#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (no network there): `run_all_gpu.sh engine`'s serve step needs fastapi /
# starlette / pydantic / uvicorn, and the OpenAI client is used when present (else plain HTTP); the peers stages need
# sentencepiece (the machine has 0.2.2).
# Run here (PyPI reachable) from the repository root; .whl/ is git-ignored and travels with the device call's
# carry=[".whl"] (about 11 MB). Versions are pinned to what the CI environment runs; the machine has Python 3.12.
#   bash benchmarks/gpu_wheels.sh && run(command="bash benchmarks/run_all_gpu.sh engine", carry=[".whl"])
# run_all_gpu.sh installs them with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` when .whl/
# exists. The machine already has h11, click, httpx, idna, certifi, tqdm, jinja2, prometheus-client.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 uvicorn==0.54.0
      annotated-types==0.7.0 annotated-doc==0.0.7 typing-inspection==0.4.2 typing-extensions==4.16.0
      openai==3.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
      idna==3.20 anyio==4.16.0 opentelemetry-api==1.45.2
      sentencepiece==0.2.3  # the peers stages: the synthetic model's tokenizer (llama.cpp's converter reads it)
      gguf==0.19.0  # gpu_loan.sh: the Q4_0 GGUF writer (benchmarks/common/gguf_checkpoint.py; pure Python)
      llguidance==1.9.1)  # serve's guided decoding (response_format; without it the server warns and refuses those)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WANT[@]}"
ls -la .whl
du -sh .whl
