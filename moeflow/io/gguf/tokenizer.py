"""The tokenizer and chat template a GGUF file carries in its metadata, as the tokenizer files moeflow reads.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary, merges and special token ids under
``tokenizer.ggml.*`` and the chat template under ``tokenizer.chat_template``. transformers rebuilds the fast
tokenizer from them (``AutoTokenizer.from_pretrained(directory, gguf_file=...)``, its own GGUF integration); this
module writes that tokenizer once as ``tokenizer.json`` plus a ``tokenizer_config.json`` (special tokens, chat
template) into a cache directory keyed by the file's path, size and modification time, which the rest of moeflow
(``Tokenizer``, chat templates, the server, guided decoding) reads like any checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

from moeflow.errors import CheckpointError
from moeflow.io.gguf.files import GGUFFiles
from moeflow.user_cache import cache_dir

log = logging.getLogger(__name__)
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}


def cache_root() -> Path:
    """``$MOEFLOW_CACHE_DIR/gguf-tokenizers`` (default ``~/.cache/moeflow``)."""
    base = cache_dir()
    return Path(base) / "gguf-tokenizers"


def tokenizer_directory(files: GGUFFiles, model_type: str) -> Path | None:
    """A directory holding ``tokenizer.json`` and ``tokenizer_config.json`` made from ``files``' metadata (made once
    per file and cached), or None when the file has no tokenizer. CheckpointError naming the file when
    transformers cannot rebuild it; a warning and None when transformers is not installed."""
    if "tokenizer.ggml.tokens" not in files.metadata:
        return None
    stat = files.path.stat()
    key = hashlib.sha256(f"{files.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    out = cache_root() / key
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    try:
        backend = _rebuild(files, model_type)
    except ImportError:
        log.warning("%s: the tokenizer in the GGUF metadata needs transformers to be rebuilt (pip install "
                    "'moeflow[gguf]'); loading without a tokenizer", files.path)
        return None
    except NoConverterError as e:
        log.warning("%s; loading without a tokenizer", e)
        return None
    except Exception as e:  # transformers raises many types on a vocabulary it cannot rebuild
        raise CheckpointError(f"{files.path}: transformers could not rebuild the tokenizer from the GGUF metadata "
                              f"(tokenizer.ggml.model {files.get('tokenizer.ggml.model')!r}): "
                              f"{type(e).__name__}: {e}") from e
    tokens = files.metadata["tokenizer.ggml.tokens"]
    config = {}
    for name, key in SPECIAL_IDS.items():
        i = files.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            config[name] = tokens[i]
    template = files.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
    backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    (tmp / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")  # harmony fallback
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out


# the tokenizer fields transformers reads as metadata arrays
_ARRAY_FIELDS = ("tokens", "token_type", "scores", "merges", "added_tokens")


class NoConverterError(Exception):
    """The installed transformers (< 5.24) has no GGUF tokenizer converter for the file's architecture."""


def _rebuild(files: GGUFFiles, model_type: str):
    """The ``tokenizers.Tokenizer`` transformers builds from the metadata: its GGUF tokenizer builders
    (``transformers.integrations.gguf``, 5.24+: keyed by the tokenizer type, any architecture), else (older
    transformers: only the architectures it loads) the converter ``AutoTokenizer.from_pretrained(gguf_file=...)``
    calls, on the metadata as its reader returns it with every array field a list again: that reader (5.17) turns a
    one-element array into its element, and the converter then splits a file's only merge "a b" character by
    character (TypeError from tokenizers); a vocabulary without merges gets them from :func:`sentencepiece_merges`
    (the same merges, without transformers 5.17's quadratic loop). Older transformers keys its converters by
    architecture and has none for some (5.17: gpt-oss, DeepSeek-V2/V3): :class:`NoConverterError`, raised before
    its reader runs (5.17's reader fails on a gpt-oss file's YaRN fields under numpy 2.5)."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return _rebuild_before_5_24(files, model_type)
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(files.path))
    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


def _rebuild_before_5_24(files: GGUFFiles, model_type: str):
    try:
        from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError:  # a transformers laid out otherwise: its own entry point
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(files.path.parent), gguf_file=files.path.name).backend_tokenizer
    architecture = str(files.get("general.architecture"))
    if converter_name(architecture, model_type, GGUF_TO_FAST_CONVERTERS) is None:
        import transformers

        raise NoConverterError(f"{files.path}: transformers {transformers.__version__} cannot rebuild the tokenizer of "
                               f"a GGUF file of architecture {architecture!r} ({model_type}); transformers >= 5.24 "
                               f"can")
    parsed = load_gguf_checkpoint(str(files.path), return_tensors=False)
    tokenizer = dict(parsed["tokenizer"])
    for key in _ARRAY_FIELDS:
        if key in tokenizer and not isinstance(tokenizer[key], list):
            tokenizer[key] = [tokenizer[key]]
    if "merges" not in tokenizer and "tokens" in tokenizer and "scores" in tokenizer:
        merges = sentencepiece_merges(tokenizer["tokens"], tokenizer["scores"])
        if merges is not None:
            tokenizer["merges"] = merges
    return convert_gguf_tokenizer(parsed["config"]["model_type"], tokenizer)[0]


def converter_name(architecture: str, model_type: str, converters: Collection[str]) -> str | None:
    """The name under which transformers < 5.24 keys the GGUF tokenizer converter of a file of ``architecture``
    (``general.architecture``, e.g. "llama", "qwen3moe", "gpt-oss") that moeflow reads as ``model_type``, among
    ``converters`` (its ``GGUF_TO_FAST_CONVERTERS``), or None when it has none: the architecture as the file spells
    it ("llama": Mixtral's files too), with "_" for "-", or moeflow's model type ("qwen3_moe" for "qwen3moe")."""
    return next((n for n in (architecture, architecture.replace("-", "_"), model_type) if n in converters), None)


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[str] | None:
    """The merges transformers 5.17 derives for a vocabulary stored without them (a SentencePiece GGUF, e.g. the GPU
    loan's synthetic one): every split of a token into two tokens, a token's splits by their halves' scores, then
    all by the token's score, highest first; as "left right" strings, the form a file stores. Its own loop tests
    membership in the token list (quadratic: ~1 min at 16k tokens on a CPU here, minutes at Mixtral's 32k, where
    5.24 takes 2 s); here a set. None when a token holds a space (the strings would not split back)."""
    if any(" " in t for t in tokens):
        return None
    vocab = {t: scores[i] for i, t in enumerate(tokens)}
    known = set(tokens)
    merges = []
    for token, score in vocab.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in known and token[i:] in known]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    return [f"{left} {right}" for left, right, _ in merges]
