"""The module paths of version 0.1, importable through 0.2 with a ``DeprecationWarning``.

Version 0.2 moved the flat modules into subpackages (see CHANGELOG.md). Rather than leave 33 two-line
stub files at the top of the package, where they would hide the tree the move was for, one import hook
serves the old paths from this table: ``import streampack.sequences`` gives a module whose attributes are
those of :mod:`streampack.samples.sequences`, and warns when one is used. Pickles that name the old paths
(``streampack.sequences.PackedSequences``) load the same classes. The hook goes in 0.3.

Names renamed in 0.2 keep their old name the same way: :func:`renamed` makes a module's ``__getattr__``
that serves an old name with a warning, :func:`renamed_method` a method's old name.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

#: Old module path -> where it lives now.
MOVED = {
    "streampack.blockshuffle": "streampack.order.blockshuffle",
    "streampack.build": "streampack.builder.coordinator",
    "streampack.collate": "streampack.loader.collate",
    "streampack.demo": "streampack.cli.demo",
    "streampack.discovery": "streampack.inputs.discovery",
    "streampack.engines": "streampack.builder.executors",
    "streampack.follow": "streampack.loader.follow",
    "streampack.holdout": "streampack.samples.split",
    "streampack.layout": "streampack.samples.layout",
    "streampack.ledger": "streampack.format.ledger",
    "streampack.localcopy": "streampack.store.localcopy",
    "streampack.mixconfig": "streampack.loader.mixconfig",
    "streampack.mixture": "streampack.order.mixture",
    "streampack.options": "streampack.builder.options",
    "streampack.packing": "streampack.samples.packing",
    "streampack.permutation": "streampack.order.permutation",
    "streampack.pieces": "streampack.tokenizer.pieces",
    "streampack.pipeline": "streampack.builder.pipeline",
    "streampack.prefetch": "streampack.loader.prefetch",
    "streampack.progress": "streampack.builder.progress",
    "streampack.provenance": "streampack.loader.provenance",
    "streampack.publish": "streampack.builder.publish",
    "streampack.remote": "streampack.store.remote",
    "streampack.sequences": "streampack.samples.sequences",
    "streampack.sft": "streampack.inputs.sft",
    "streampack.sources": "streampack.inputs.sources",
    "streampack.stagetimes": "streampack.builder.timings",
    "streampack.tiktoken_json": "streampack.tokenizer.tiktoken_json",
    "streampack.tokenize": "streampack.tokenizer.backends",
    "streampack.verify": "streampack.reader.verify",
    "streampack.writer": "streampack.builder.writer",
    "streampack._linkproxy": "streampack.testing.linkproxy",
    "streampack._synthetic": "streampack.testing.caches",
}


class _Alias(types.ModuleType):
    """An old path: each attribute is the new module's, with a warning naming where it went.

    ``streampack.build`` and ``streampack.verify`` are also functions of the package: importing their old
    module sets the package's attribute to this module, so calling it calls the function.
    """

    def __getattr__(self, name: str) -> Any:
        new = MOVED[self.__name__]
        if not name.startswith("__"):
            warnings.warn(
                f"{self.__name__} moved to {new} in streampack 0.2; the old path goes in 0.3",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(importlib.import_module(new), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function = getattr(importlib.import_module(MOVED[self.__name__]), self.__name__.rpartition(".")[2])
        return function(*args, **kwargs)


class _AliasFinder:
    """Finds the old paths of :data:`MOVED` (only once the real files are not found).

    A meta path finder and loader by protocol (``find_spec``, ``create_module``, ``exec_module``), not by
    the ``importlib.abc`` classes: importing those loads ``importlib.resources`` and ``tempfile``, a
    tenth of what ``import streampack`` costs.
    """

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path; ``None`` for every other name."""
        if fullname not in MOVED:
            return None
        # typeshed's LoaderProtocol asks for the legacy load_module(); the import system uses exec_module.
        return importlib.util.spec_from_loader(fullname, self)  # type: ignore[arg-type]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """An empty :class:`_Alias` module."""
        return _Alias(spec.name, f"Moved to {MOVED[spec.name]} (deprecated path).")

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: attributes are looked up in the new module when used."""


def install() -> None:
    """Add the finder once, after the standard ones."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def renamed(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` that serves the old ``names`` (old -> new) of its objects, with a
    ``DeprecationWarning``; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated: it is now {names[name]} (the same object); the old name goes "
            "in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], names[name])

    return __getattr__


def renamed_method(old: str, new: str) -> Any:
    """A method ``old`` that calls the method ``new`` of its object, with a ``DeprecationWarning``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        kind = type(self).__name__
        warnings.warn(f"{kind}.{old} is deprecated: it is now {kind}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)(*args, **kwargs)

    method.__name__ = old
    method.__doc__ = f"Deprecated: :meth:`{new}`, under its old name."
    return method
