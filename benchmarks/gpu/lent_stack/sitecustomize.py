"""The lent GPU machine's package set, mirrored on a CPU machine (benchmarks/results/gpu_stack/README.md): with this
folder on PYTHONPATH (inherited by every subprocess the GPU lane starts), the top-level modules named in
``blocked.txt`` (distributions a venv holds that the lent machine lacks: KINDS.md's list of 2026-11-17) are
unimportable from the venv's site-packages, as on the machine; they still import from any other sys.path entry (a
script's own entries, e.g. llama.cpp's converter inserting its gguf-py) and from the folders in ``$LENT_STACK_ALLOW``
(colon-separated: ``.whl/`` installed with ``pip install --no-index --no-deps --target``, as gpu_loan.sh does into
/tmp/site). ``run.sh`` sets it up; nothing in moeflow imports this."""

import importlib.machinery
import os
import sys
import sysconfig

_here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_here, "blocked.txt")) as _f:
    _blocked = {w for line in _f for w in line.split("#")[0].split()}
_allow = [p for p in os.environ.get("LENT_STACK_ALLOW", "").split(":") if p]
_site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}


class _LentStackFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if "." in name or name not in _blocked:
            return None
        where = [p for p in sys.path if os.path.realpath(p or ".") not in _site] + _allow
        spec = importlib.machinery.PathFinder.find_spec(name, where)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not on the lent GPU machine)", name=name)
        return spec


sys.meta_path.insert(0, _LentStackFinder)
