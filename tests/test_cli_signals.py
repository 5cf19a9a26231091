"""Ctrl-C and SIGTERM in the ``moeflow`` command (issue 35), sent to real subprocesses: ``chat`` at its prompt and
mid-reply, ``quantize`` mid-conversion, exit quietly with 128 + the signal (130, 143) and leave nothing behind.

Each subprocess runs ``moeflow.cli.main`` with one function wrapped to print a marker and wait at a known point
(after the first converted tensor, after the third streamed token), so the signal lands there and not by luck of
timing. SIGINT gets Python's default handler back first: a test run in the background inherits it ignored, as a
terminal never would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import make_tiny_checkpoint

import moeflow

ROOT = Path(moeflow.__file__).resolve().parent.parent
WAIT_S = 120

PRELUDE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
"""
SLOW_QUANTIZE = PRELUDE + """
import moeflow.tools.quantize as convert
real = convert.converted_tensors
def converted_tensors(*args, **kwargs):
    for i, chunk in enumerate(real(*args, **kwargs)):
        yield chunk
        if i == 0:
            print("MARK", flush=True)
            time.sleep(WAIT)
convert.converted_tensors = converted_tensors
from moeflow.cli import main
sys.exit(main(sys.argv[1:]))
"""
SLOW_REPLY = PRELUDE + """
import moeflow.streaming as streaming
real, seen = streaming.TextStreamer.put, []
def put(self, ids):
    real(self, ids)
    seen.append(1)
    if len(seen) == 4:  # the prompt, then three reply tokens
        print("MARK", flush=True)
        time.sleep(WAIT)
streaming.TextStreamer.put = put
from moeflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Command:
    """``python -c CODE ARGS`` with PYTHONPATH at this tree; stdout read as it comes (a prompt has no newline)."""

    def __init__(self, code: str, *args: str, stdin: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", code.replace("WAIT", str(WAIT_S)), *args], env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.out = b""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            self.out += chunk

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while text.encode() not in self.out:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {text!r} in the output: {self.out!r} {self.proc.stderr.read()!r}")
            time.sleep(0.05)

    def signal(self, signum: int) -> tuple[int, str]:
        """Send ``signum``; the exit status and stderr."""
        self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return rc, self.proc.stderr.read().decode()


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_quantize_leaves_nothing_and_exits_quietly(tmp_path, signum, status):
    src = make_tiny_checkpoint(tmp_path / "fp32")
    cmd = Command(SLOW_QUANTIZE, "quantize", str(src), str(tmp_path / "awq"), "--group-size", "32")
    cmd.wait_for("MARK")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".awq.partial-")]  # the premise: mid-write
    rc, err = cmd.signal(signum)
    assert (rc, "Traceback" in err) == (status, False), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32"]  # no .awq.partial-*/, no awq/


def test_ctrl_c_at_the_chat_prompt_exits_quietly():
    cmd = Command(PRELUDE + "from moeflow.cli import main\nsys.exit(main(sys.argv[1:]))", "chat", "--device", "cpu",
                  stdin=True)
    cmd.wait_for("you> ")
    rc, err = cmd.signal(signal.SIGINT)
    assert (rc, "Traceback" in err) == (130, False), err


def test_ctrl_c_mid_reply_exits_quietly():
    cmd = Command(SLOW_REPLY, "chat", "--device", "cpu", "--greedy", "--max-new-tokens", "40", stdin=True)
    cmd.wait_for("you> ")
    cmd.proc.stdin.write(b"hello\n")
    cmd.proc.stdin.flush()
    cmd.wait_for("MARK")
    rc, err = cmd.signal(signal.SIGINT)
    assert (rc, "Traceback" in err) == (130, False), err
