"""Imports point one way: api -> engine -> {families, offload} -> moe -> kernels -> io/quant -> chat, with no cycles.

Every import statement of every module under moeflow/ is read with ``ast`` (function-level imports
included: a lazy import is still a dependency). Each module has a rank; a module may import only
modules of a lower rank or of its own package group. ``families`` and ``offload`` share a rank, so
neither may import the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moeflow"

# (module prefix, group, rank): the longest matching prefix decides; groups may import within themselves
LAYERS = [
    ("moeflow.errors", "base", 0), ("moeflow.config", "base", 0), ("moeflow.streaming", "base", 0),
    ("moeflow.compile_boundary", "base", 0), ("moeflow.user_cache", "base", 0),
    ("moeflow.chat", "chat", 0.5),  # templates, reply markup, guided decoding: read by io's tokenizer and the engine
    ("moeflow.quant", "io", 1), ("moeflow.io", "io", 1), ("moeflow.trace", "io", 1),  # trace: the file format
    ("moeflow.kernels", "kernels", 2),
    ("moeflow.moe", "moe", 3),
    ("moeflow.trace.synthetic", "trace-synthetic", 3.5),  # synthetic traces route with moe.routing
    ("moeflow.families", "families", 4),
    ("moeflow.offload", "offload", 4),
    ("moeflow.engine", "engine", 5),
    ("moeflow.api", "api", 6), ("moeflow", "package", 7),  # moeflow/__init__.py re-exports the API
    # tools built on the whole library
    ("moeflow.tools.record", "tools", 8), ("moeflow.tools.quantize", "tools", 8), ("moeflow.cli", "tools", 8),
    ("moeflow.sim", "tools", 8), ("moeflow.serve", "tools", 8), ("moeflow.__main__", "tools", 8),
]


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """moeflow modules imported anywhere in the file (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("moeflow") and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> tuple[str, float]:
    best = max((p for p in LAYERS if name == p[0] or name.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best[1], best[2]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_read(graph):
    assert "moeflow.engine.build" in graph and "moeflow.families.base" in graph["moeflow.families.mixtral"]
    assert "moeflow.offload.backend" in graph


def test_imports_point_down(graph):
    bad = []
    for src, targets in graph.items():
        group, rank = layer_of(src)
        for dst in targets:
            dst_group, dst_rank = layer_of(dst)
            if dst_group == group or dst_rank < rank:
                continue
            bad.append(f"{src} ({group}) imports {dst} ({dst_group})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_offload_and_families_do_not_know_each_other(graph):
    offload_modules = [n for n in graph if n.startswith("moeflow.offload")]
    assert offload_modules, "moeflow/offload is missing"
    for src in offload_modules:
        for dst in graph[src]:
            assert not dst.startswith(("moeflow.families", "moeflow.engine", "moeflow.api")), (src, dst)
    for src in (n for n in graph if n.startswith("moeflow.families")):
        assert not any(d.startswith("moeflow.offload") for d in graph[src]), src


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components: every component is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_submodule_shadows_a_name_of_its_package():
    """Loading ``pkg.sub`` binds ``sub`` on ``pkg``: a submodule named like a function, class or variable that
    ``pkg/__init__.py`` defines replaces it when something imports the submodule later (``moeflow.kernels.route``,
    the function, against a ``route/`` package). Safe only where ``__init__`` loads the submodule itself before
    its last binding of the name (``from pkg.evaluate import evaluate``)."""
    modules = module_names()
    bad = []
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        children = {m.rpartition(".")[2] for m in modules if m.rpartition(".")[0] == name}
        loaded: set[str] = set()
        shadowed: dict[str, bool] = {}  # name -> bound while its submodule was not loaded yet
        for node in ast.parse(path.read_text(), str(path)).body:
            bound: set[str] = set()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = {node.name}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound = {n.id for tgt in targets for n in ast.walk(tgt) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if node.module.startswith(name + ".") and len(parts) > len(name.split(".")):
                    loaded.add(parts[len(name.split("."))])
                for a in node.names:
                    if node.module == name and a.name in children:
                        loaded.add(a.name)  # ``from pkg import sub``: binds the submodule itself
                    else:
                        bound.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                loaded.update(a.name.split(".")[len(name.split("."))] for a in node.names
                              if a.name.startswith(name + ".") and a.asname is None)
            for b in bound & children:
                shadowed[b] = b not in loaded
        bad += [f"{name}.{c}" for c, unsafe in sorted(shadowed.items()) if unsafe]
    assert not bad, "submodules that would replace a name their package defines: " + ", ".join(bad)


FORMAT_REGISTRY = ("moeflow/kernels/formats/",)  # the only files that may read a format's storage name


def _is_format_kind(node: ast.AST) -> bool:
    """``<...>fmt.kind`` (fmt, self.fmt, pool.fmt, ...): a format's storage name."""
    return (isinstance(node, ast.Attribute) and node.attr == "kind"
            and ast.unparse(node.value).rsplit(".", 1)[-1].endswith("fmt"))


def test_formats_are_asked_not_compared():
    """Callers ask the format object (its capabilities and methods); no ``fmt.kind == "awq"`` and no
    ``getattr(fmt, "<flag>")`` discovery outside the format registry (``moeflow/kernels/formats/``)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel.startswith(FORMAT_REGISTRY):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(_is_format_kind(n) for n in (node.left, *node.comparators)):
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and node.args
                  and ast.unparse(node.args[0]).rsplit(".", 1)[-1].endswith("fmt")):
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "compare/discover a format outside moeflow/kernels/formats/:\n" + "\n".join(offenders)


BACKEND_NAMES = {"torch", "triton", "cpu-int4"}
# where a kernel choice's name may be read: the kernels' dispatch and custom ops, the format registry, and the one
# function that resolves the model's choice
BACKEND_RESOLVERS = {"moeflow/kernels/dispatch.py": None, "moeflow/kernels/experts/ops.py": None,
                     "moeflow/engine/build.py": "resolve_kernels"}


def _names_a_backend(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple | ast.Set):
        return any(_names_a_backend(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in BACKEND_NAMES


def _compares_backend(node: ast.Compare) -> bool:
    """A comparison with a backend name (``'torch' in sys.modules`` names a module, not a backend)."""
    sides = (node.left, *node.comparators)
    return any(_names_a_backend(n) for n in sides) and "sys.modules" not in map(ast.unparse, sides)


def test_kernel_backends_are_asked_not_compared():
    """``kernels.uses_triton(choice, device)`` / ``kernels.uses_cpu_int4(choice)`` instead of ``backend == "triton"``
    outside the kernels' dispatch, the format registry and ``engine.build.resolve_kernels``."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel.startswith(FORMAT_REGISTRY) or (rel in BACKEND_RESOLVERS and BACKEND_RESOLVERS[rel] is None):
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                   and f.name == BACKEND_RESOLVERS.get(rel) for n in ast.walk(f)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and id(node) not in allowed
                    and _compares_backend(node)):
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "kernel backend names compared:\n" + "\n".join(offenders)


def test_the_checks_catch_a_comparison(tmp_path, monkeypatch):
    """The two checks above read what they should (planted comparisons are found)."""
    planted = tmp_path / "moeflow" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('def f(pool, backend):\n    return pool.fmt.kind == "awq" or getattr(pool.fmt, "extended", 0)\n'
                       'def g(backend):\n    return backend in ("triton", "auto")\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", planted.parent)
    with pytest.raises(AssertionError, match="planted.py:2"):
        test_formats_are_asked_not_compared()
    with pytest.raises(AssertionError, match="planted.py:4"):
        test_kernel_backends_are_asked_not_compared()
