"""The house's one-way rule, from the code: no import cycle among nbwatch's modules
(function-local and TYPE_CHECKING imports included), and every SQL statement inside the
`nbwatch.store` package."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nbwatch"
SQL = re.compile(r"\b(SELECT|INSERT INTO|DELETE FROM|UPDATE \w+ SET|CREATE TABLE)\b")


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here[: len(here) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t not in (name, "nbwatch"):
                found.add(t)
    return found


def test_no_import_cycle():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_sql_statement_is_in_the_store():
    leaks = [str(p.relative_to(PKG.parent)) for m, p in modules().items()
             if not m.startswith("nbwatch.store") and SQL.search(p.read_text(encoding="utf-8"))]
    assert not leaks, f"SQL outside nbwatch/store/: {leaks}"
