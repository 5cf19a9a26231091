"""The CPU int4 form cache (``from_pretrained(cpu_form_cache=True)``, engine/cpu_form_cache.py): resident experts on
``device="cpu"`` converted on the first load and written under the user cache, mapped on later loads (views of the
cache file, no conversion); the same greedy tokens as converting every time (a tiny AWQ checkpoint and a Q4_0 GGUF);
a changed checkpoint file misses (a new key), a cache file cut short is warned about and rewritten. ~5 s."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers import make_tiny_awq_checkpoint, make_tiny_model

from moeflow import MoEModel
from moeflow.engine import cpu_form_cache
from moeflow.kernels.cpu.native import native_available
from moeflow.moe import CpuInt4Experts

pytestmark = pytest.mark.skipif(not native_available(), reason="moeflow's CPU kernels do not build here (no compiler)")


def _run(path, ids, **kw):
    model = MoEModel.from_pretrained(path, device="cpu", **kw)
    try:
        assert type(model.experts) is CpuInt4Experts
        return model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=[]), model.experts.form_mapping
    finally:
        model.close()


def _checkpoints(tmp_path):
    yield "awq", make_tiny_awq_checkpoint(tmp_path / "awq", seed=3)
    pytest.importorskip("gguf")
    from gguf_models import T, write_gguf

    path = tmp_path / "q4_0.gguf"
    write_gguf(make_tiny_model(seed=4), path, expert_types=T.Q4_0, other_type=T.Q8_0)
    yield "q4_0", path


def test_cached_forms_give_the_converted_tokens_and_stale_files_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))
    forms = tmp_path / "cache" / "cpu_forms"
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    for kind, path in _checkpoints(tmp_path):
        expected, none = _run(path, ids)
        assert none is None
        before = set(forms.glob("*.safetensors")) if forms.is_dir() else set()
        first, mapping = _run(path, ids, cpu_form_cache=True)  # converts, writes
        assert mapping is None and torch.equal(first, expected), kind
        written = set(forms.glob("*.safetensors")) - before
        assert len(written) == 1 and not list(forms.glob("*.tmp")), kind
        again, mapping = _run(path, ids, cpu_form_cache=True)  # maps the file
        assert mapping is not None and torch.equal(again, expected), kind
        # a checkpoint file changed (its time): another key, converted again and written beside the old one
        target = path if path.is_file() else next(path.glob("*.safetensors"))
        st = target.stat()
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        stale, mapping = _run(path, ids, cpu_form_cache=True)
        assert mapping is None and torch.equal(stale, expected), kind
        assert len(set(forms.glob("*.safetensors")) - before) == 2, kind
        # the newest file cut short: warned about, converted again, rewritten whole
        newest = max(set(forms.glob("*.safetensors")) - before, key=lambda p: p.stat().st_mtime_ns)
        os.truncate(newest, newest.stat().st_size // 2)
        with pytest.warns(RuntimeWarning, match="cannot be used"):
            cut, mapping = _run(path, ids, cpu_form_cache=True)
        assert mapping is None and torch.equal(cut, expected), kind
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fixed, mapping = _run(path, ids, cpu_form_cache=True)
        assert mapping is not None and torch.equal(fixed, expected), kind
    assert cpu_form_cache.FORM_VERSION >= 1
