"""The package's structure, measured from its source: import graph, cycles, sizes, public names.

Run ``python -m tests.structure`` from the project root for the table; ``tests/test_architecture.py``
holds the rules it measures. Only ``ast`` is used: nothing of streampack is imported except, for the
count of top-level names, ``streampack.__all__`` in a fresh process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "streampack"

#: How an import statement runs: at import time, inside a function, or only for the type checker.
TOP, LAZY, TYPING = "top", "lazy", "typing"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (dotted module names), ``kind`` one of TOP, LAZY, TYPING;
    ``delegation`` when the import only serves delegations (see :func:`delegating_imports`)."""

    source: str
    target: str
    kind: str
    line: int
    delegation: bool = False


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by the name of its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_package(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def _resolve(module: str | None, level: int, here: str, known: dict[str, Path]) -> str | None:
    """The dotted name an ``import``/``from`` names, relative imports resolved against ``here``."""
    if level == 0:
        return module
    base = here.split(".")
    if not _is_package(here, known):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _targets(node: ast.Import | ast.ImportFrom, here: str, known: dict[str, Path]) -> Iterator[str]:
    """The modules of ours one import statement loads (the deepest known module of each name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(node.module, node.level, here, known)
        if base is None:
            return
        # `from pkg import sub` loads pkg.sub when it is a module; `from pkg import name` loads pkg.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != here:
            yield name


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for child in ast.iter_child_nodes(node):
        child_kind = kind
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            child_kind = TYPING
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == TOP:
            child_kind = LAZY
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, child_kind
        yield from _walk(child, child_kind)


def is_delegation(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``function`` is a delegation: its body a docstring, imports and one ``return`` of a value.

    Sugar on a lower type that hands the call to a module above it (pandas' ``DataFrame.plot`` calls
    ``pandas.plotting``): the logic, and its documentation, live above.
    """
    body = function.body[1:] if ast.get_docstring(function, clean=False) is not None else function.body
    return (
        bool(body)
        and all(isinstance(statement, (ast.Import, ast.ImportFrom)) for statement in body[:-1])
        and isinstance(body[-1], ast.Return)
        and body[-1].value is not None
    )


def delegating_imports(tree: ast.Module) -> set[int]:
    """The ``id`` of each import statement of ``tree`` that only serves delegations (:func:`is_delegation`):
    an import inside one, and a ``TYPE_CHECKING`` import whose every name is used only in the annotations
    of delegations."""
    functions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_delegation(node)
    ]
    found = {id(s) for f in functions for s in f.body if isinstance(s, (ast.Import, ast.ImportFrom))}
    annotations: list[ast.expr] = []
    for f in functions:
        arguments = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs, f.args.vararg, f.args.kwarg]
        annotations += [a.annotation for a in arguments if a is not None and a.annotation is not None]
        annotations += [f.returns] if f.returns is not None else []
    in_annotations = {id(n) for a in annotations for n in ast.walk(a) if isinstance(n, ast.Name)}
    uses: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            uses.setdefault(node.id, []).append(id(node))
    for node, kind in _walk(tree, TOP):
        if kind == TYPING and isinstance(node, ast.ImportFrom):
            names = [alias.asname or alias.name for alias in node.names]
            if all(uses.get(n) and all(u in in_annotations for u in uses[n]) for n in names):
                found.add(id(node))
    return found


def edges(known: dict[str, Path] | None = None) -> list[Edge]:
    """Every import of one of our modules by another, with its kind and line."""
    known = known or modules()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        delegating = delegating_imports(tree)
        for node, kind in _walk(tree, TOP):
            found.extend(
                Edge(name, target, kind, node.lineno, id(node) in delegating)
                for target in set(_targets(node, name, known))
            )
    return found


def cycles(all_edges: Iterable[Edge], kinds: set[str]) -> list[list[str]]:
    """The strongly connected components (more than one module) of the graph of the given kinds."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.source, set())
        graph.setdefault(e.target, set())
        if e.kind in kinds:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def private_imports(known: dict[str, Path] | None = None) -> list[str]:
    """``module:line name`` for every import of another module's private name (``from streampack.x import
    _y``): a helper another module needs is public in its package, or the two belong together."""
    known = known or modules()
    found = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("streampack")
            ):
                if node.module == name:
                    continue
                found += [f"{name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def lone_bases(known: dict[str, Path] | None = None) -> list[str]:
    """``module.Base -> module.Subclass`` for every class of ours subclassed exactly once, in another
    module, and never made itself (no call of its name anywhere in the package): a base that holds half of
    one class, cut along a line count rather than an idea. Protocols and exceptions are left out."""
    known = known or modules()
    defined: dict[str, str] = {}
    subclasses: dict[str, list[str]] = {}
    called: set[str] = set()
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if any(b in ("Protocol", "Exception") or b.endswith("Error") for b in bases):
                    continue
                defined.setdefault(node.name, name)
                for base in bases:
                    subclasses.setdefault(base, []).append(f"{name}.{node.name}")
            elif isinstance(node, ast.Call):
                func = node.func
                called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return [
        f"{defined[base]}.{base} -> {subs[0]}"
        for base, subs in sorted(subclasses.items())
        if base in defined
        and len(subs) == 1
        and not subs[0].startswith(defined[base] + ".")
        and base not in called
    ]


def top_level_names() -> list[str]:
    """``streampack.__all__``, read in a fresh process (so nothing here is imported)."""
    code = "import streampack, json; print(json.dumps(sorted(streampack.__all__)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    import json

    return list(json.loads(out.stdout))


def main() -> None:
    """Print the structure table."""
    known = modules()
    all_edges = edges(known)
    top_cycles = cycles(all_edges, {TOP})
    any_cycles = cycles([e for e in all_edges if not e.delegation], {TOP, LAZY, TYPING})
    private, lone = private_imports(known), lone_bases(known)
    rows = [
        ("modules", len(known), ""),
        ("source lines", sum(len(p.read_text().splitlines()) for p in known.values()), ""),
        ("module-level import cycles", len(top_cycles), "goal 0"),
        ("cycles counting lazy and TYPE_CHECKING imports", len(any_cycles), "delegations aside"),
        ("imports of another module's private names", len(private), "goal 0"),
        ("bases holding half of one class", len(lone), "goal 0"),
        ("top-level names", len(top_level_names()), "goal <= 15"),
    ]
    width = max(len(r[0]) for r in rows)
    for label, value, note in rows:
        print(f"{label:<{width}}  {value:>5}  {note}")
    for title, group in (("module-level cycles", top_cycles), ("all cycles", any_cycles)):
        for component in group:
            print(f"{title}: {' <-> '.join(component)}")
    for line in private + lone:
        print(line)


if __name__ == "__main__":
    main()
