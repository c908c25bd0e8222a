"""The rules between the parts of the package (docs/ARCHITECTURE.md), checked on the source with ``ast``.

Every import of one of our modules by another is an edge (``tests/structure.py``), at module level, inside a
function, or under ``TYPE_CHECKING``. The layers may only be crossed downwards, the build side never reaches
the load side, and no module-level cycle exists. One upward edge is allowed, precisely: the ``Cache``'s
*delegations* to samples and to the exporters (:func:`sugar`). The few edges the redesign has still to cut are
listed in ``KNOWN``, each with why it is there: a new edge against the rules fails, and so does a listed one
that is gone (so the list only shrinks).
"""

from __future__ import annotations

import ast

import pytest

from tests.structure import (
    LAZY,
    TOP,
    TYPING,
    Edge,
    cycles,
    delegating_imports,
    edges,
    is_delegation,
    lone_bases,
    modules,
    private_imports,
)

#: The packages, lowest first. A module may import its own package and anything on a lower layer.
LAYERS = [
    {"errors", "_checks"},
    {"format"},
    {"store"},
    {"inputs", "tokenizer"},
    {"builder"},
    {"reader"},
    {"samples", "order"},
    {"loader"},
    {"follow"},
    {"runs"},
    {"torch", "hf", "lightning", "torchdata", "grain", "jax", "interop"},
    {"cli", "testing", "__init__", "__main__"},
]
BUILD_SIDE = {"inputs", "tokenizer", "builder"}
LOAD_SIDE = {
    "reader",
    "samples",
    "order",
    "loader",
    "follow",
    "runs",
    "torch",
    "hf",
    "lightning",
    "torchdata",
    "grain",
    "jax",
    "interop",
}

#: (importer, imported) edges against the rules that the next step of the redesign cuts, and why.
KNOWN: dict[tuple[str, str], str] = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(package: str) -> int:
    for number, members in enumerate(LAYERS):
        if package in members:
            return number
    raise AssertionError(f"streampack.{package} is on no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def sugar(edge: Edge) -> bool:
    """Whether ``edge`` is a delegation of the ``Cache`` to samples or the exporters, the one upward edge
    the rules allow.

    ``Cache.sequences/packed/documents/split/all_documents`` and ``Cache.export`` are sugar on the lower type
    whose logic (and documentation) lives above it, as pandas' ``DataFrame.plot`` hands the call to
    ``pandas.plotting``: a LAZY import inside a function of ``streampack/reader/cache.py`` whose body is a
    docstring, imports and one ``return`` (:func:`tests.structure.is_delegation`), or a ``TYPE_CHECKING``
    import there whose names only annotate such functions. These edges are also left out of the cycle
    checks. Nothing else of the reader reaches up: ``open()`` reads other formats' files through
    ``streampack.reader.foreign``, below it.
    """
    upward = edge.source == "streampack.reader.cache" and _package(edge.target) in {"samples", "interop"}
    return upward and edge.delegation and edge.kind in {LAZY, TYPING}


def broken_rules(edge: Edge) -> list[str]:
    """The rules one edge breaks (none for an edge inside one package that goes down, nor for
    :func:`sugar`)."""
    source, target = _package(edge.source), _package(edge.target)
    broken: list[str] = []
    if sugar(edge):
        return broken
    if source in BUILD_SIDE and target in LOAD_SIDE:
        broken.append("the build side imports the load side")
    if source == "order" and target in {"reader", "samples"}:
        broken.append("an order imports the reader or samples")
    if source == "reader" and target == "samples":
        broken.append("the reader imports samples (samples depend on the reader)")
    if source != target and _layer(target) > _layer(source):
        broken.append(f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)})")
    return broken


@pytest.fixture(scope="module")
def all_edges() -> list[Edge]:
    return edges(modules())


def test_every_package_has_a_layer(all_edges: list[Edge]) -> None:
    for name in modules():
        _layer(_package(name))


def test_no_import_breaks_the_layer_rules_beyond_the_known_ones(all_edges: list[Edge]) -> None:
    unexpected = [
        f"{e.source}:{e.line} -> {e.target} ({e.kind}): {'; '.join(broken_rules(e))}"
        for e in all_edges
        if broken_rules(e) and (e.source, e.target) not in KNOWN
    ]
    assert not unexpected, "imports against docs/ARCHITECTURE.md's rules:\n" + "\n".join(unexpected)


def test_every_known_exception_still_exists(all_edges: list[Edge]) -> None:
    seen = {(e.source, e.target) for e in all_edges}
    gone = sorted(set(KNOWN) - seen)
    assert not gone, f"these edges are cut: remove them from KNOWN: {gone}"


def test_no_module_imports_another_modules_private_names() -> None:
    """A helper another module needs is public in its package, or the two modules belong together."""
    assert private_imports() == []


#: Bases with one subclass in another module, each with why it is one (none may be added).
LONE_BASES: dict[str, str] = {}


def test_no_base_class_holds_half_of_a_single_subclass() -> None:
    """A class is as long as its idea: a base never made itself, whose only subclass lives in another
    module, is one class cut in two (compose a value the class holds instead)."""
    found = set(lone_bases())
    assert found <= set(LONE_BASES), sorted(found - set(LONE_BASES))
    assert set(LONE_BASES) <= found, f"gone, remove from LONE_BASES: {sorted(set(LONE_BASES) - found)}"


def test_format_imports_nothing_of_ours_but_errors(all_edges: list[Edge]) -> None:
    for e in all_edges:
        if _package(e.source) == "format":
            assert _package(e.target) in {"format", "errors"}, e


def test_no_module_level_import_cycle(all_edges: list[Edge]) -> None:
    assert cycles(all_edges, {TOP}) == []


def test_the_cycles_through_lazy_imports_are_only_the_known_ones(all_edges: list[Edge]) -> None:
    allowed = {frozenset(pair) for pair in KNOWN}
    graph = [e for e in all_edges if not sugar(e)]  # the reader's delegations are sugar, not a dependency
    for component in cycles(graph, {TOP, LAZY, TYPING}):
        inside = {(e.source, e.target) for e in graph if e.source in component and e.target in component}
        assert any(frozenset(pair) in allowed or pair in KNOWN for pair in inside), component


def test_the_reader_reaches_samples_only_through_delegations(all_edges: list[Edge]) -> None:
    upward = [e for e in all_edges if _package(e.source) == "reader" and _package(e.target) == "samples"]
    assert upward, "Cache.sequences/packed/documents/split/all_documents delegate to samples"
    assert all(sugar(e) for e in upward), [e for e in upward if not sugar(e)]
    # Anything else of the reader that imports samples breaks the rules, lazily or not.
    for kind in (TOP, LAZY, TYPING):
        assert broken_rules(Edge("streampack.reader.cache", "streampack.samples.split", kind, 1))
    assert broken_rules(Edge("streampack.reader.cache", "streampack.samples.split", TOP, 1, delegation=True))
    assert broken_rules(
        Edge("streampack.order.mixture", "streampack.samples.split", LAZY, 1, delegation=True)
    )
    # open() delegates to nothing above it: its other formats' readers are in the reader.
    assert broken_rules(Edge("streampack.reader.opening", "streampack.interop", LAZY, 1, delegation=True))


_DELEGATIONS = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from streampack.samples.split import DocumentSet
    from streampack.samples.sequences import PackedSequences

class Cache:
    def all_documents(self) -> DocumentSet:
        "Every document."
        from streampack.samples.split import all_documents

        return all_documents(self)

    def thinking(self) -> object:
        "Not a delegation: it computes before it returns."
        from streampack.samples.split import all_documents

        documents = all_documents(self)
        return documents

    def windows(self, n: int) -> int:
        from streampack.samples.sequences import PackedSequences

        return len(PackedSequences(self, n))
"""


def test_a_delegation_is_a_docstring_imports_and_one_return() -> None:
    tree = ast.parse(_DELEGATIONS)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {name for name, f in functions.items() if is_delegation(f)} == {"all_documents", "windows"}
    delegating = delegating_imports(tree)
    imports = {n.lineno: id(n) in delegating for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    # DocumentSet only annotates delegations; PackedSequences is also called in one (still a delegation),
    # and the import inside `thinking` serves a function that computes.
    assert imports == {2: False, 4: True, 5: False, 10: True, 16: False, 22: True}
