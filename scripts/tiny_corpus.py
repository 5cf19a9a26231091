"""The embedded model's training text and tokenizer (scripts/train_tiny_model.py): text that ships with Python
itself, so nothing is downloaded, cut into held-out and training blocks; a byte-level tokenizer (id == byte).

* every topic of ``pydoc_data.topics`` (sorted by topic name), then
* the module docstring of every pure-Python stdlib module, read with ``ast`` from the source file (nothing is
  imported; test packages, ``lib2to3`` and site-packages are skipped), sorted by dotted module name, then
* the ``__doc__`` of the interpreter's built-in modules (``sys.builtin_module_names``, sorted).

Held-out split: 4096-byte blocks, every 20th (index 19, 39, ...) held out: 5 % of the bytes spread evenly.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import platform
import sys
import sysconfig
import warnings
from pathlib import Path

BLOCK_BYTES = 4096
HELDOUT_EVERY = 20  # every 20th block is held out (5 %)
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib2to3"}

# ----------------------------------------------------------------------------------------------------------------
# Corpus


def _stdlib_module_docstrings() -> list[tuple[str, str]]:
    """(dotted module name, docstring) for every stdlib .py file, parsed with ast, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test"):
                continue
            path = Path(dirpath) / name
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if not parts:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tree = ast.parse(path.read_bytes(), filename=str(path))
            except (SyntaxError, ValueError, OSError):
                continue
            doc = ast.get_docstring(tree, clean=True)
            if doc and doc.strip():
                found[".".join(parts)] = doc.strip()
    return sorted(found.items())


def _builtin_module_docstrings() -> list[tuple[str, str]]:
    out = []
    for name in sorted(sys.builtin_module_names):
        try:
            doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 - a built-in that cannot be imported is simply skipped
            continue
        if doc and doc.strip():
            out.append((name, doc.strip()))
    return out


def collect_corpus() -> tuple[bytes, dict]:
    """The training text as UTF-8 bytes, and a description of where it came from."""
    from pydoc_data.topics import topics

    docs = [topics[key].strip() for key in sorted(topics)]
    modules = _stdlib_module_docstrings()
    builtins = _builtin_module_docstrings()
    docs += [doc for _, doc in modules] + [doc for _, doc in builtins]
    data = ("\n\n".join(docs) + "\n").encode("utf-8")
    info = {
        "python": platform.python_version(),
        "pydoc_topics": len(topics),
        "stdlib_module_docstrings": len(modules),
        "builtin_module_docstrings": len(builtins),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "split": f"{BLOCK_BYTES}-byte blocks, every {HELDOUT_EVERY}th block (index % {HELDOUT_EVERY} == "
        f"{HELDOUT_EVERY - 1}) held out",
    }
    return data, info


def split_corpus(data: bytes) -> tuple[bytes, bytes]:
    """(train, held-out): every HELDOUT_EVERY-th BLOCK_BYTES block is held out."""
    blocks = [data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES)]
    train = b"".join(b for i, b in enumerate(blocks) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1)
    heldout = b"".join(b for i, b in enumerate(blocks) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
    return train, heldout


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def build_byte_tokenizer():
    """A ``tokenizers`` tokenizer whose ids are the UTF-8 bytes: byte-level BPE, 256-symbol vocab, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins, unordered
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + n in byte order.
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = 0
    vocab = {}
    for b in range(256):
        if b in printable:
            ch = chr(b)
        else:
            ch = chr(256 + extra)
            extra += 1
        vocab[ch] = b
    if set(vocab) != set(alphabet):
        raise RuntimeError("byte-level alphabet of this tokenizers version is not GPT-2's bytes_to_unicode")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    check_byte_tokenizer(tok)
    return tok


def check_byte_tokenizer(tok) -> None:
    samples = [
        "The import statement",
        "  leading spaces, tabs\tand\nnew lines\r\n",
        "def f(x):\n    return x ** 2  # comment",
        "naïve café — “quotes” ünïcödé €100 日本語 🐍",
        "".join(chr(c) for c in range(128)),
    ]
    for text in samples:
        ids = tok.encode(text).ids
        if ids != list(text.encode("utf-8")):
            raise RuntimeError(f"byte tokenizer: ids of {text!r} are not its UTF-8 bytes")
        if tok.decode(ids) != text:
            raise RuntimeError(f"byte tokenizer: {text!r} does not round-trip")
    if tok.get_vocab_size() != 256:
        raise RuntimeError("byte tokenizer: vocabulary is not 256")
