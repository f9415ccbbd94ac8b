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


def rooms() -> dict[str, set[str]]:
    """The imports between the package's rooms: a top-level module, or a sub-package as one
    (nbwatch.store.writer is in nbwatch.store); the package's face left out."""
    mods = modules()

    def room(m: str) -> str:
        return ".".join(m.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        if m == "nbwatch":
            continue
        graph.setdefault(room(m), set()).update(
            room(t) for t in imports(m, p, mods) if room(t) != room(m) and t != "nbwatch")
    return graph


def test_the_rooms_stand_in_layers_at_most_ten_deep():
    """No two sub-packages (or a sub-package and a module) import each other, even through
    others: the layers read one way, down; and the longest chain of rooms is short enough
    to hold in one's head (a newcomer follows it from an entry point to the records)."""
    graph = rooms()
    depth: dict[str, list[str]] = {}
    on_path: list[str] = []

    def chain(r: str) -> list[str]:
        if r in on_path:
            raise AssertionError("rooms in a circle: " + " -> ".join(on_path[on_path.index(r):]
                                                                     + [r]))
        if r not in depth:
            on_path.append(r)
            depth[r] = [r] + max((chain(t) for t in sorted(graph.get(r, ()))), key=len,
                                 default=[])
            on_path.pop()
        return depth[r]

    longest = max((chain(r) for r in sorted(graph)), key=len)
    assert len(longest) <= 10, " -> ".join(longest)
    assert "nbwatch.records" in longest  # the scan follows the chain to the ground floor


def test_every_module_fits_450_lines():
    """A file one screen can explain (STYLE.md): no module of the package past 450 lines."""
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
