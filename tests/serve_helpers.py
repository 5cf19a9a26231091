"""Start `moeflow serve` as a user does (a subprocess on 127.0.0.1, any free port) and the greedy reference."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import moeflow
from moeflow import MoEOffloadedMixtral
from moeflow.chat.template import ChatTemplate, stop_token_ids
from moeflow.cli import embedded_model_path

ROOT = Path(moeflow.__file__).resolve().parent.parent
MODEL_NAME = "tiny-mixtral-awq"
START_TIMEOUT_S = 120


class Server:
    """``moeflow serve ARGS`` in a subprocess; ``url`` once it printed its address; ``stop()`` ends it."""

    def __init__(self, *args: str, device: str = "cpu") -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "moeflow", "serve", "--port", "0", "--device", device,
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError("moeflow serve did not start in time:\n" + "".join(self.output)) from None
            if line is None:
                raise RuntimeError("moeflow serve exited:\n" + "".join(self.output))
            found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                self.url = found.group(1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Reference:
    """Single-request greedy ``generate`` on the embedded model, as the server runs it (same kernels; the
    device's default dtype: fp32 on the CPU, fp16 on a GPU, as ``moeflow serve --device``)."""

    def __init__(self, device: str = "cpu") -> None:
        self.model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(), device=device)
        tok = self.model.tokenizer
        self.tokenizer = tok
        self.stop_ids = list(stop_token_ids(ChatTemplate.from_directory(tok.path.parent),
                                            self.model.generation_config.eos_ids(), tok.encode))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def greedy(self, ids: list[int], max_new_tokens: int) -> tuple[str, int]:
        """(text, completion tokens) of generate(do_sample=False) stopped by the chat stop tokens."""
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=self.stop_ids)[0, len(ids):].tolist()
        n = len(out)
        if out and out[-1] in self.stop_ids:
            out = out[:-1]
        return self.tokenizer.decode(out), n


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in /metrics text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name + (f"{{{want}}}" if want else ""):
            return float(value)
    return 0.0
