"""A griffe extension for the docs site: the docstrings' Sphinx markup, as Sphinx would show it.

The docstrings cross-reference with Sphinx roles (``:class:`~streampack.Loader```), which Markdown would
show as written (``:class:`` before the name). This rewrites each role as a code span of the name Sphinx
would show: the last component after ``~``, the title of ``title <target>``, else the whole target; and
the ``::`` that introduces a literal block (an indented block, code in Markdown too) as ``:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: A paragraph that introduces a literal block, ``Example::``, which Sphinx shows as ``Example:``.
LITERAL = re.compile(r"(?<=\S)::$", re.M)
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`(?P<target>[^`]+)`")


def plain(match: re.Match[str]) -> str:
    """The code span Sphinx would show for one role."""
    target = match.group("target")
    titled = re.fullmatch(r"(?P<title>.*?)\s*<(?P<target>[^>]+)>", target)
    if titled:
        return f"`{titled.group('title')}`"
    if target.startswith("~"):
        return f"`{target[1:].rsplit('.', 1)[-1]}`"
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring (see the module's docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, once the tree is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = LITERAL.sub(":", ROLE.sub(plain, obj.docstring.value))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the docstring of a top-level package, which ``on_object`` is not called for."""
        self.on_object(obj=pkg)
