"""The rules between the parts of the package (docs/ARCHITECTURE.md), checked on the source with ``ast``.

Every import of one of our modules by another is an edge (``tests/structure.py``), at module level, inside
a function, or under ``TYPE_CHECKING``. The layers may only be crossed downwards, the build side never
reaches the load side, and no module-level cycle exists. The few edges the redesign has still to cut are
listed in ``KNOWN``, each with why it is there: a new edge against the rules fails, and so does a listed one
that is gone (so the list only shrinks).
"""

from __future__ import annotations

import pytest

from tests.structure import LAZY, TOP, TYPING, Edge, cycles, edges, modules

#: The packages, lowest first. A module may import its own package and anything on a lower layer.
LAYERS = [
    {"errors", "_aliases", "_checks"},
    {"format"},
    {"store"},
    {"inputs", "tokenizer"},
    {"builder"},
    {"reader"},
    {"samples", "order"},
    {"loader"},
    {"torch", "hf", "lightning", "torchdata", "grain", "jax", "interop"},
    {"cli", "testing", "__init__"},
]
BUILD_SIDE = {"inputs", "tokenizer", "builder"}
LOAD_SIDE = {
    "reader",
    "samples",
    "order",
    "loader",
    "torch",
    "hf",
    "lightning",
    "torchdata",
    "grain",
    "jax",
    "interop",
}

#: (importer, imported) edges against the rules that the next step of the redesign cuts, and why.
KNOWN = {
    ("streampack.reader", "streampack.samples.sequences"): "Cache.sequences/packed/documents build samples",
    ("streampack.reader", "streampack.samples.split"): "Cache.split builds a DocumentSet",
    ("streampack.reader", "streampack.samples.packing"): "Cache.packed's too_long type",
    ("streampack.samples.layout", "streampack.samples.packing"): "Bins reloads its plan on unpickling",
    ("streampack.samples.split", "streampack.reader"): "the samples knot: a split reopens and builds samples",
    ("streampack.reader", "streampack.interop"): "Cache.export delegates to the exporters (a lazy import)",
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(package: str) -> int:
    for number, members in enumerate(LAYERS):
        if package in members:
            return number
    raise AssertionError(f"streampack.{package} is on no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def broken_rules(edge: Edge) -> list[str]:
    """The rules one edge breaks (none for an edge inside one package that goes down)."""
    source, target = _package(edge.source), _package(edge.target)
    broken = []
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


def test_format_imports_nothing_of_ours_but_errors(all_edges: list[Edge]) -> None:
    for e in all_edges:
        if _package(e.source) == "format":
            assert _package(e.target) in {"format", "errors"}, e


def test_no_module_level_import_cycle(all_edges: list[Edge]) -> None:
    assert cycles(all_edges, {TOP}) == []


def test_the_cycles_through_lazy_imports_are_only_the_known_ones(all_edges: list[Edge]) -> None:
    allowed = {frozenset(pair) for pair in KNOWN}
    for component in cycles(all_edges, {TOP, LAZY, TYPING}):
        inside = {
            (e.source, e.target)
            for e in all_edges
            if e.source in component and e.target in component and e.kind in {TOP, LAZY, TYPING}
        }
        assert any(frozenset(pair) in allowed or pair in KNOWN for pair in inside), component
