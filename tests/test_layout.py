"""The package's layout: no import cycles among solforge's modules.

Every module under solforge/ is parsed (ast, nothing imported: no torch), and every import in it
counts, at module level or inside a function (a lazy import hides a cycle, it does not remove it),
except under `if TYPE_CHECKING:`, which never runs. `from a.b import c` where a.b.c is a module is an
import of a.b.c, not of a.b (importing a.b.c does run a.b's __init__ first, but a package's
__init__ importing its own submodules is how a package re-exports names; that edge is not counted).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "solforge"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not `.__init__`)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, skipping the bodies of `if TYPE_CHECKING:` (not their else)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.stmt, ast.Module, ast.ExceptHandler, ast.match_case)):
            todo.extend(ast.iter_child_nodes(node))  # imports are statements: no need to enter expressions


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for a in node.names:
            sub = f"{base}.{a.name}"
            found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted, and a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _path(g: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One concrete cycle through a component (for the failure message): a -> b -> ... -> a."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    todo = [start]
    while todo:  # breadth first from start, inside the component, until an edge back to start
        v = todo.pop(0)
        for w in sorted(g[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    return comp


def test_no_import_cycles() -> None:
    g = graph()
    assert len(g) > 50 and "solforge.kernels.rmsnorm" in g  # the walk found the package
    found = cycles(g)
    assert not found, "import cycles among solforge's modules:\n" + "\n".join(
        f"  {' -> '.join(_path(g, comp))}   (modules: {', '.join(comp)})" for comp in found)


def test_the_checker_sees_cycles(tmp_path: Path) -> None:
    """The graph and cycle finder on a small package: a lazy import, a from-import of a submodule, a
    relative import and a TYPE_CHECKING import, each counted (or not) as the module docstring says."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from solforge import a  # the package re-exports a\n",
        "a.py": "from solforge.sub import b\n",  # solforge.sub.b (a module), not solforge.sub
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import g\n    return g\n",  # relative, inside a function
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from solforge import d\n"
                "else:\n    import solforge.a\ng = 1\n",
        "d.py": "import solforge.c\n",  # c -> d only under TYPE_CHECKING: no cycle
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    g = graph(tmp_path)
    assert g == {"solforge": {"solforge.a"}, "solforge.a": {"solforge.sub.b"}, "solforge.sub": set(),
                 "solforge.sub.b": {"solforge.c"}, "solforge.c": {"solforge.a"}, "solforge.d": {"solforge.c"}}
    (comp,) = cycles(g)
    assert comp == ["solforge.a", "solforge.c", "solforge.sub.b"]
    assert _path(g, comp) == ["solforge.a", "solforge.sub.b", "solforge.c", "solforge.a"]
    (pkg / "c.py").write_text("g = 1\n")
    assert cycles(graph(tmp_path)) == []
