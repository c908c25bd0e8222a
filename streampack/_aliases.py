"""Old names of objects renamed in 0.2, served with a ``DeprecationWarning``.

:func:`renamed` makes a module's ``__getattr__`` that serves an old name with a warning,
:func:`renamed_method` a method's old name.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any


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
