"""No import cycle among skyrl_tx's modules: every import counts, a function's deferred one too (it still ties the two
modules together; deferring only hides the cycle until both are half-loaded)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "skyrl_tx"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the skyrl_tx modules it imports (`from a.b import c` is a.b.c when that is a module, else a.b)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_skyrl_tx_has_no_import_cycle() -> None:
    assert cycles(import_graph(PACKAGE)) == [], "import cycles among skyrl_tx modules: break each one"


def test_the_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: a cycle through a deferred import is found."""
    root = tmp_path / "skyrl_tx"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("from skyrl_tx.sub import b\n")
    (root / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (root / "c.py").write_text("import skyrl_tx.a\ndef g(): pass\n")
    (root / "d.py").write_text("from skyrl_tx import a\n")
    assert cycles(import_graph(root)) == [["skyrl_tx.a", "skyrl_tx.c", "skyrl_tx.sub.b"]]
