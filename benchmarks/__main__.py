"""The one entry point of the benchmarks: ``python -m benchmarks`` lists them, ``python -m benchmarks NAME [ARGS]``
runs one (run from the repository root).

NAME is a module under ``benchmarks/`` written with dots or slashes (``gpu.headline``, ``gpu/headline.py``). A
script runs as ``python -m benchmarks.NAME ARGS`` would run it; a pytest-benchmark suite (``bench_*.py`` without a
``__main__`` guard) runs under pytest with ARGS passed on (e.g. ``--benchmark-json=out.json``). A suite that is also
a script (``cpu/bench_int4.py`` prints its table) runs as a script here; ``python -m pytest FILE`` runs its suite.
"""

from __future__ import annotations

import argparse
import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"__init__", "__main__", "conftest"}


def _summary(path: Path) -> tuple[str, bool]:
    """The first sentence of ``path``'s docstring, and whether the file runs as a script (has a ``__main__``
    guard)."""
    source = path.read_text()
    doc = " ".join((ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].split())
    end = doc.find(". ")
    return (doc if end < 0 else doc[: end + 1]), '__name__ == "__main__"' in source


def available() -> dict[str, tuple[Path, str, str]]:
    """``name -> (path, kind, summary)`` of every benchmark: kind ``script`` or ``pytest-benchmark``; helpers that
    neither run as a script nor are a pytest-benchmark suite (checkpoint writers, plugins) are left out."""
    found = {}
    for path in sorted(HERE.rglob("*.py")):
        rel = path.relative_to(HERE)
        if path.stem in SKIP or "results" in rel.parts:
            continue
        summary, is_script = _summary(path)
        kind = "pytest-benchmark" if path.stem.startswith("bench_") and not is_script else "script"
        if kind == "script" and not is_script:
            continue
        found[".".join(rel.with_suffix("").parts)] = (path, kind, summary)
    return found


def _name(text: str) -> str:
    return text.removesuffix(".py").removeprefix("benchmarks/").removeprefix("benchmarks.").replace("/", ".")


def listing(width: int = 118) -> str:
    lines, folder = [], None
    for name, (_, kind, summary) in available().items():
        top = name.split(".")[0]
        if top != folder:
            folder = top
            lines.append(f"\n{folder}/")
        tag = " [pytest-benchmark]" if kind == "pytest-benchmark" else ""
        line = f"  {name:<28} {summary}{tag}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="benchmarks (NAME: summary):" + listing())
    ap.add_argument("name", nargs="?", help="the benchmark to run (listed below); none: print the list")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments (NAME --help shows them)")
    args = ap.parse_args(argv)
    if args.name is None or args.name == "list":
        print("benchmarks (python -m benchmarks NAME [ARGS]):" + listing())
        return 0
    name = _name(args.name)
    found = available()
    if name not in found:
        close = [n for n in found if name in n]
        ap.error(f"no benchmark {args.name!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                                  "; `python -m benchmarks` lists them"))
    path, kind, _ = found[name]
    if kind == "pytest-benchmark":
        import pytest

        return pytest.main([str(path), *args.args])
    sys.argv = [str(path), *args.args]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
