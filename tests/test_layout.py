"""The one-way house (docs/layout.md): no package of accelexp imports one that imports it back.

Read from the source (every `import accelexp.X` and `from accelexp.X import`, at any depth of a
module, lazy imports included), so a new arrow up fails here before it tangles two packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO

PACKAGE = REPO / "accelexp"


def unit(module: str) -> str:
    """`accelexp.parallel.ddp` -> `parallel`; `accelexp.train` -> `train`."""
    return module.split(".")[1]


def arrows() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")  # parallel, train, ...
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "accelexp":
                targets = [f"accelexp.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accelexp."):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("accelexp.")]
            else:
                continue
            found.setdefault(source, set()).update(unit(t) for t in targets if unit(t) != source)
    return found


def cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    todo = [(start, [start])]
    while todo:
        node, path = todo.pop()
        for target in graph.get(node, ()):
            if target == start:
                return [*path, start]
            if target not in path:
                todo.append((target, [*path, target]))
    return None


def test_no_package_imports_one_that_imports_it_back():
    graph = arrows()
    assert {"parallel", "timing", "stats"} <= graph["engine"]  # the reader sees the imports
    cycles = [cycle for start in sorted(graph) if (cycle := cycle_through(start, graph))]
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_run_record_is_cheap_to_import():
    """Writers and readers (the report, the config) import `accelexp.record`: it imports no other
    part of accelexp, nor torch or mlflow."""
    assert not arrows().get("record")
    loaded = "import sys, accelexp.record; print(*sorted(sys.modules))"
    modules = subprocess.run(
        [sys.executable, "-c", loaded], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [m for m in modules if m.split(".")[0] in ("torch", "mlflow", "omegaconf")]
