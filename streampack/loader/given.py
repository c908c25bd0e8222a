"""What a :class:`~streampack.loader.Loader` is given, checked: its options, its sources and their order.

A loader takes its source as one dataset, a dict of named ones (read in the ``order`` given), a source
that comes with its order (:class:`~streampack.order.Ordered`: a Mixture), or one that grows while it is
read (:class:`~streampack.loader.growing.Growing`); its settings as a
:class:`~streampack.loader.options.LoaderOptions`, keywords, or both. :func:`given` turns each into the
same three things: the options, the sources (each probed once, as the loader reads it), and the order
(the one given, or one made from the options for a single dataset), and refuses what does not fit
together, naming the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from streampack.errors import OptionsError
from streampack.loader.growing import Growing
from streampack.loader.options import (
    LoaderOptions,
    check_dtype,
    check_size,
    unknown_keyword,
    with_keywords,
)
from streampack.loader.reading import DataSource, Source, vocab_size_of
from streampack.order import Order, Ordered

__all__ = ["given"]

_OPTION_NAMES = {field.name for field in dataclasses.fields(LoaderOptions)}


def given(
    what: str,
    source: DataSource | Mapping[str, DataSource] | Ordered | Growing,
    order: Order | None,
    options: LoaderOptions | None,
    keywords: Mapping[str, Any],
) -> tuple[LoaderOptions, list[Source], Order]:
    """What a Loader is given, checked: its options (the object's, with the keywords' fields), its
    sources, and their order (the one given, or for one dataset the one its options describe).

    Args:
        what: the class being made, for messages (``"Loader"``, ``"Follow"``).
        source: one dataset, a dict of name -> dataset, a Mixture, or a growing source.
        order: the order given, or None.
        options: the options object given, or None.
        keywords: the option fields given as keywords.

    Raises:
        TypeError: ``source`` is a list or tuple, or has no ``__len__`` or ``__getitem__``; a keyword
            names no option.
        OptionsError: (a ``ValueError``) an option is out of range; ``batch_size`` does not divide by
            ``world_size``; the dataset holds less than one global batch (with ``drop_last``);
            ``dtype`` cannot hold the cache's ids; an order or a mixture is given with ``seed``,
            ``shuffle`` or ``epochs``; an order does not name one source per source given; or a dict of
            sources comes without an order.
    """
    unknown = sorted(set(keywords) - _OPTION_NAMES)
    if unknown:
        raise unknown_keyword(what, unknown[0], sorted(_OPTION_NAMES))
    # seed=None and shuffle=None say "not given": the defaults, or an order's own.
    keywords = {k: v for k, v in keywords.items() if v is not None or k not in ("seed", "shuffle")}
    parts, order = _sources_and_order(source, order)
    if order is not None:
        _refuse_order_options(order, {k: keywords.get(k) for k in ("seed", "shuffle", "epochs")})
    opts = with_keywords(LoaderOptions, options, keywords)
    if order is not None and len(order.names) != len(parts):
        raise OptionsError(
            f"the order reads {len(order.names)} sources ({', '.join(order.names)}), the Loader was "
            "given one; give a dict of name -> source, one per name of the order"
        )
    sources = [Source(part) for part in parts]
    if order is None:  # the order of one dataset, from the options
        from streampack.order.blockshuffle import single_order

        first = sources[0]
        order = single_order(
            len(first), seed=opts.seed, shuffle=opts.shuffle, epochs=opts.epochs, data=first.fingerprint
        )
        check_size(opts, len(first))
    check_dtype(
        opts, [source.dtype for source in sources], [vocab_size_of(source.data) for source in sources]
    )
    return opts, sources, order


def _sources_and_order(
    source: DataSource | Mapping[str, DataSource] | Ordered | Growing, order: Order | None
) -> tuple[list[DataSource], Order | None]:
    """The sources a Loader reads and the order given with them (None: the Loader makes one)."""
    if isinstance(source, Growing):  # what it holds now, in the order that grows with it
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} grows with its own order; give it without order=..."
            )
        view = source.view()  # one source, or several by name (a mixture with a source that grows)
        return (list(view.values()) if isinstance(view, Mapping) else [view]), source.order
    if isinstance(source, Ordered):  # a Mixture: its sources, and itself their order
        if order is not None:
            raise OptionsError(
                f"a {type(source).__name__} reads its sources in its own order; give it, or its sources with "
                "order=..., not both"
            )
        sources, order = source.sources_and_order()
        return list(sources.values()), order
    if isinstance(source, Mapping):
        if order is None:
            raise OptionsError(
                f"several sources ({', '.join(map(str, source))}) are read in an order: pass order=..., or "
                "a streampack.order.mixture.Mixture of them"
            )
        if tuple(source) != tuple(order.names):
            raise OptionsError(
                f"the sources must be named as the order names them, in its order: {list(order.names)} "
                f"(got {list(source)})"
            )
        return list(source.values()), order
    return [source], order


def _refuse_order_options(order: Order, given: Mapping[str, object]) -> None:
    """An order given sets seed, shuffle and end itself: refuse the single-dataset order options rather
    than ignore them."""
    kind = type(order).__name__
    for name, value in given.items():
        if value is not None:
            where = f"{kind}(..., {name}=...)"
            if name == "epochs":
                where = "the order's own end, e.g. Mixture(stop='first_exhausted') or Shuffled(n, epochs=...)"
            raise OptionsError(
                f"{name}= sets the order of a single dataset; {kind} is an order of its own: use {where} "
                f"(got {name}={value!r})"
            )
