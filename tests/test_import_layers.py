"""The import directions docs/architecture.md draws are the code's: each module imports only modules
listed above it in the Layers drawing, and no two modules import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zpp_compile"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str], top_level_only: bool = False) -> set[str]:
    """The zpp_compile modules `path` imports (inside functions too, unless top_level_only)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & modules
            found |= submodules or ({target} & modules)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found - {name}


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _drawn_rows() -> list[str]:
    """The rows of architecture.md's Layers drawing, top first: 'config', 'codegen', ..."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```", 2)[1]
    return [
        m.group(1).removesuffix(".py").removesuffix("/") for m in re.finditer(r"^  (\S+?(?:\.py|/))\s", drawing, re.M)
    ]


def _row_of(module: str, rows: list[str]) -> str:
    first = module.split(".")[1]
    return "config" if first == "migration" else first  # migration.py is drawn in config's row


def test_every_import_goes_up_the_drawing():
    modules = _all_modules()
    rows = _drawn_rows()
    undrawn = {_row_of(m, rows) for m in modules if m != "zpp_compile"} - set(rows)
    assert not undrawn, f"docs/architecture.md's Layers drawing lacks {sorted(undrawn)}"
    wrong = []
    for name, path in modules.items():
        if name == "zpp_compile":
            continue  # the package imports everything
        for target in _imports(path, set(modules)):
            if target == "zpp_compile":
                continue
            source_row, target_row = _row_of(name, rows), _row_of(target, rows)
            if source_row != target_row and rows.index(target_row) > rows.index(source_row):
                wrong.append(f"{name} imports {target}")
    assert not wrong, f"imports against the drawing's direction: {wrong}"


def test_no_import_cycles():
    modules = _all_modules()
    graph = {
        name: _imports(path, set(modules), top_level_only=True) - {"zpp_compile"} for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, (
                f"import cycle: {' -> '.join(trail[trail.index(nxt) :] + [node, nxt]) if nxt in trail else node + ' -> ' + nxt}"
            )
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_checkpoint_never_imports_sharding():
    modules = _all_modules()
    for name, path in modules.items():
        if name.startswith("zpp_compile.checkpoint"):
            assert "zpp_compile.sharding" not in _imports(path, set(modules)), name


def test_cluster_benchmark_and_its_worker_do_not_import_each_other():
    """cluster_worker.py imports cluster.py (link_bytes); the launcher must not import the worker back."""
    tree = ast.parse((ROOT / "benchmarks" / "cluster.py").read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.endswith("cluster_worker") for m in imported), imported
