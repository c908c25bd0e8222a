"""Training while the build runs: a :class:`~streampack.Loader` over a cache whose build is still going.

A :class:`Follow` serves the windows of the *finished* cache, ``open(path).sequences(seq_len,
overlap=overlap)``, as soon as the build has committed them, in **eras** of consecutive windows whose
sizes double from ``first_era`` up to ``largest_era``, each shuffled on its own
(:mod:`streampack.follow.order`). The order depends on the build and the settings alone, never on when the
ledger was read: every process computes the same eras, a resume is exact, and no window is served twice or
before it is committed. The cost is latency: an era waits for the units before it. A batch that waits
``timeout`` seconds while the ledger shows nothing new raises :class:`~streampack.errors.BuildStalledError`.
After the last era come epochs of the finished cache (``then="epochs"``) or the end (``then="end"``).

With ``layout="packed"`` or ``"documents"`` eras count documents, each planned on its own once committed
(:mod:`streampack.follow.eras`).

``Follow(path, ...)`` is ``Loader(GrowingCache(path, ...))``: the committed part of the cache as a source
that grows (:mod:`streampack.loader.growing`).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from streampack import reader
from streampack._checks import check_int
from streampack.errors import BuildStalledError, OptionsError
from streampack.follow.eras import EraPlan, era_plan, joined
from streampack.follow.options import FollowKeywords, FollowLayout, FollowOptions, split_keywords
from streampack.follow.order import Eras, FollowOrder
from streampack.format import ledger
from streampack.format.manifest import Manifest, build_digest
from streampack.format.names import MANIFEST, shard_name
from streampack.loader import Loader
from streampack.loader.options import LoaderOptions, with_keywords
from streampack.order import MAX_POSITION
from streampack.samples.sequences import PackedSequences
from streampack.store import LocalStore, is_remote, open_store
from streampack.store.files import load_manifest, read_entry
from streampack.store.localcopy import cached_store

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Eras", "Follow", "FollowLayout", "FollowOptions", "FollowOrder", "GrowingCache"]

# Units past the first unfinished one whose ledger entries are read while waiting (at most every
# _WATCH_SECONDS), to tell a build that works on later units from a stalled one.
_WATCHED_UNITS = 32
_WATCH_SECONDS = 5.0


class _Ledger:
    """What a build has committed, read from its ledger: the contiguous prefix of the stream, and whether
    the build is complete. A read starts at the first unfinished unit."""

    def __init__(self, store: LocalStore, units: list[str]) -> None:
        self.store, self.units = store, units
        self.done: list[ledger.LedgerEntry] = []  # the entries of the first units, all finished
        self.running: ledger.LedgerEntry | None = None  # the first unfinished unit's, as last read
        self._done_tokens = 0

    _done_docs: int | None = None  # None: not counted yet

    def read(self) -> tuple[int, int, bool]:
        """``(tokens of the committed prefix, its documents, complete)``."""
        self.running = None  # until read again: a failed read leaves no entry in another unit's place
        if self._done_docs is None:
            self._done_docs = sum(entry.docs for entry in self.done)
        progress = self._progress(len(self.done))
        while progress is not None and progress.done:
            self.done.append(progress)
            self._done_tokens += progress.tokens
            self._done_docs += progress.docs
            progress = self._progress(len(self.done))
        self.running = progress
        if progress is None:
            return self._done_tokens, self._done_docs, True
        return self._done_tokens + progress.tokens, self._done_docs + progress.docs, False

    def later(self) -> tuple[int, ...]:
        """Tokens committed by the units after the first unfinished one (up to ``_WATCHED_UNITS``)."""
        first = len(self.done) + 1
        later = [self._progress(i) for i in range(first, min(first + _WATCHED_UNITS, len(self.units)))]
        return tuple(p.tokens for p in later if p is not None)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"done": list(self.done)}  # a copy's reads must not grow this one's list

    def progress(self) -> list[ledger.LedgerEntry]:
        """Every unit's entry as last read, up to the first unfinished one; empty entries after it."""
        first = [*self.done, *([self.running] if self.running is not None else [])]
        return first + [ledger.LedgerEntry(unit=unit) for unit in self.units[len(first) :]]

    def _progress(self, unit: int) -> ledger.LedgerEntry | None:
        if unit >= len(self.units):
            return None
        return read_entry(self.store, shard_name(unit), self.units[unit])


class GrowingCache:
    """The committed part of a cache whose build runs, as a source that grows
    (:class:`~streampack.loader.growing.Growing`), in the order of a
    :class:`~streampack.follow.order.FollowOrder`, known era by era.

    Args:
        path: the cache directory or URL (its build may not have written its manifest yet).
        options: the windows, eras and waiting.
        seed: the shuffle seed of the eras.
        batch_size: the loader's global batch size, and
        drop_last: its ``drop_last``: with ``then="epochs"``, the finished cache must hold one batch.

    Raises:
        OptionsError: an object-storage option for a local cache.
        BuildStalledError: the build wrote no manifest within ``timeout``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: FollowOptions,
        *,
        seed: int,
        batch_size: int,
        drop_last: bool,
    ) -> None:
        self.path, self.options = path, options
        self._batch_size, self._drop_last = batch_size, drop_last
        reading = options.reading if is_remote(path) else {}
        given = [name for name, value in options.reading.items() if value is not None]
        if given and not reading:
            raise OptionsError(
                f"{path}: {', '.join(given)} apply to caches in object storage (s3://...), not to a "
                "local cache"
            )
        self._store = cached_store(str(path), **reading) if reading else open_store(path)
        self._manifest = self._manifest_when_written()
        self._ledger = _Ledger(self._store, self._manifest.units)
        self._first: tuple[int, int, bool] | None = self._ledger.read()  # taken by the first grow()
        data: dict[str, Any] = {"build": build_digest(self._manifest), "seq_len": options.seq_len}
        if options.whole_documents:
            self.pad_id = self._pad_id()
            data.update(layout=options.layout, too_long=options.too_long, no_target=options.no_target)
            data["pad_id"] = self.pad_id
        else:
            data["overlap"] = options.overlap
        by: Literal["windows", "documents"] = "documents" if options.whole_documents else "windows"
        self.order = FollowOrder(seed=seed, eras=options.eras, then=options.then, data=data, by=by)
        self.known = 0  # positions whose samples are known and committed
        self._plans: list[EraPlan] = []  # whole documents: the plans of the eras known, in order
        self._committed: reader.Cache | None = None  # the cache as the ledger was last read

    def __repr__(self) -> str:
        o, path = self.options, str(self.path)
        return f"GrowingCache({path!r}, seq_len={o.seq_len}, overlap={o.overlap}, known={self.known})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and copy) with an order, ledger and era plans of its own, to read the ledger itself."""
        copied = {
            "order": copy.copy(self.order),
            "_ledger": copy.copy(self._ledger),
            "_plans": list(self._plans),
        }
        return self.__dict__ | copied | {"_committed": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle; also what version 0.2.0 pickled (windows only: no era plans)."""
        self.__dict__.update({"_plans": [], "_committed": None} | state)

    def fingerprint(self) -> dict[str, Any]:
        """The follow order's fingerprint: what identifies the samples it serves, in their order."""
        return self.order.fingerprint()

    def resume(self, order: FollowOrder) -> None:
        """Grow with ``order`` (this order, as a checkpoint resumed it) from now on."""
        self.order = order

    def view(self) -> PackedSequences:
        """The samples of the cache as the ledger was last read: every sample of the positions known."""
        committed = self._committed_cache()
        o = self.options
        if not o.whole_documents:
            return committed.sequences(o.seq_len, overlap=o.overlap)
        if self._first is not None:  # the eras the first read shows, which the first grow() takes
            self._samples(*self._first)
        settings: dict[str, int | str] = {"layout": f"follow-{o.layout}", "too_long": str(o.too_long)}
        settings.update(no_target=o.no_target, eras=f"{o.first_era}:{o.largest_era}")
        layout = joined(self._plans, seq_len=o.seq_len, pad_id=self.pad_id, settings=settings)
        return PackedSequences.of(committed, layout)

    def _committed_cache(self) -> reader.Cache:
        if self._committed is None:
            self._committed = reader.open_committed(self._store, self._manifest, self._ledger.progress())
        return self._committed

    def _read(self) -> tuple[int, int, bool]:
        self._committed = None  # opened again when asked: the ledger moves on
        return self._ledger.read()

    def _pad_id(self) -> int:
        """The padding id given, checked against the token dtype; else the cache's EOS id, else 0."""
        manifest, given = self._manifest, self.options.pad_id
        if given is None:
            return manifest.eos.appended if manifest.eos.appended is not None else 0
        below = int(np.iinfo(np.dtype(manifest.dtype)).max) + 1
        hint = f"an id of the cache's {manifest.dtype} tokens"
        return check_int("pad_id", given, min=0, below=below, hint=hint)

    def _samples(self, tokens: int, docs: int, complete: bool) -> int:
        """Samples of the eras committed (all once ``complete``), planning whole-document eras newly
        committed."""
        if not self.options.whole_documents:
            windows = max(0, (tokens - self.options.overlap) // self.options.seq_len)
            return windows if complete else self.order.eras.covered(windows)
        o, eras, order = self.options, self.order.eras, self.order
        while True:
            era = len(self._plans)
            first, stop = eras.start(era), eras.start(era + 1)
            if not (stop <= docs or (complete and first < docs)):
                break
            assert o.too_long is not None  # FollowOptions sets it for whole documents
            plan = era_plan(
                self._committed_cache(), first, min(stop, docs), kind=o.layout, seq_len=o.seq_len,
                too_long=o.too_long, no_target=o.no_target,
            )  # fmt: skip
            self._plans = [*self._plans, plan]
            order.learn(len(plan))
        assert order.bounds is not None
        return order.bounds[-1]

    def _manifest_when_written(self) -> Manifest:
        store, timeout = self._store, self.options.timeout
        started = time.monotonic()
        while not store.exists(MANIFEST):
            if time.monotonic() - started > timeout:
                raise BuildStalledError(
                    f"{store.describe('')}: no build has written a manifest here in {timeout:g} s; "
                    "start the build (or check the path), or raise timeout="
                )
            time.sleep(self.options.poll)
        return load_manifest(store)

    # --- growing ----------------------------------------------------------------------------------------

    def grow(self, stop: int, check: Callable[[], None]) -> None:
        """Wait until the samples of positions ``[0, stop)`` are known, or the build is done.

        Raises:
            BuildStalledError: the ledger showed nothing new for ``timeout`` seconds.
            OptionsError: the finished cache cannot serve the loader (see :meth:`_finish`).
        """
        if self._first is not None:  # what the first read showed: its view holds it, no second read
            (tokens, docs, complete), self._first = self._first, None
            samples = self._samples(tokens, docs, complete)
            if complete:  # len() and the end are known at once
                self._finish(samples, check)
            else:
                self.known = self.order.known = samples
        if stop > self.known:
            self._await(stop, check)

    def _finish(self, windows: int, check: Callable[[], None]) -> None:
        """The build is complete and holds ``windows`` samples: every position is known from now on
        (refused when ``then="epochs"`` has less than a batch, or ``check`` refuses it)."""
        o, batch = self.options, self._batch_size
        if o.then == "epochs" and (windows == 0 or (self._drop_last and windows < batch)):
            raise OptionsError(
                f"{self.path}: the finished cache holds {windows} samples of seq_len={o.seq_len}, fewer "
                f"than one global batch of {batch}: then='epochs' has nothing to repeat. Use a "
                "smaller batch_size or seq_len, or then='end'"
            )
        order = self.order
        order.finish(windows)
        try:
            check()
        except OptionsError:
            order.finish(None)
            raise
        self.known = MAX_POSITION

    def _await(self, stop: int, check: Callable[[], None]) -> None:
        """Read the ledger until the samples of positions ``[0, stop)`` are known, or the build is done."""
        order, timeout = self.order, self.options.timeout
        waited_since = watched_at = time.monotonic()
        seen: tuple[int, ...] | None = None
        later: tuple[int, ...] | None = None
        while True:
            tokens, docs, complete = self._read()
            samples = self._samples(tokens, docs, complete)
            if complete:
                self._finish(samples, check)
                return
            order.known = self.known = max(self.known, samples)
            if stop <= self.known:
                return
            now = time.monotonic()
            if now - watched_at >= min(_WATCH_SECONDS, timeout / 8):  # later units: less often
                watched_at, before, later = now, later, self._ledger.later()
                if before is not None and later != before:
                    waited_since = now
            if (tokens, len(self._ledger.done)) != seen:
                waited_since, seen = now, (tokens, len(self._ledger.done))
            elif now - waited_since > timeout:
                raise BuildStalledError(
                    f"{self.path}: the build committed nothing for {timeout:g} s while position "
                    f"{stop - 1} waited for its era ({samples} samples are known; {tokens} tokens of {docs} "
                    "documents are committed in stream order); is "
                    "the build still running? Rerun the build command to resume it, or raise timeout="
                )
            time.sleep(self.options.poll)


class Follow(Loader):
    """A :class:`~streampack.Loader` of a cache whose build is running: its windows, served once committed.

    Example::

        follow = Follow("cache/", seq_len=2048, overlap=1, batch_size=32, seed=1)
        for batch in follow:  # (32, 2049) arrays while the build runs, then epochs of the finished cache
            ...
        data = streampack.torch.DataLoader(follow, num_workers=4)  # workers, ranks, resume: as a Loader

    It is a Loader in every other way (ranks, ``output=``, ``collate``, ``state_dict``, the adapters), with
    its own order; ``len()`` is known once the build is complete (with ``then="end"``).

    Args:
        path: the cache directory or URL (its build may not have written its manifest yet).
        options: the loader's settings (:class:`~streampack.loader.options.LoaderOptions`) but
            ``shuffle`` and ``epochs``: the order is the eras'.
        follow: what it serves and how it waits (:class:`FollowOptions`).
        collate: applied to every batch before it is yielded.
        **keywords: fields of either, which replace those of the objects given.

    Raises:
        OptionsError: an option is out of range.
        BuildStalledError: the build wrote no manifest within ``timeout``, or later committed nothing new
            while a batch waited ``timeout`` seconds.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        options: LoaderOptions | None = None,
        follow: FollowOptions | None = None,
        collate: Callable[[Any], Any] | None = None,
        **keywords: Unpack[FollowKeywords],
    ) -> None:
        loading, following = split_keywords(keywords)
        # Options are checked before waiting for the build, not after.
        opts = with_keywords(LoaderOptions, options, loading)
        if opts.shuffle is not True or opts.epochs is not None:
            raise OptionsError(
                "a Follow serves the eras of the build in its own order: shuffle and epochs do not apply; "
                f"then='end' or 'epochs' says what follows them (got shuffle={opts.shuffle!r}, "
                f"epochs={opts.epochs!r})"
            )
        settings = with_keywords(FollowOptions, follow, following)
        source = GrowingCache(
            path, settings, seed=opts.seed, batch_size=opts.batch_size, drop_last=opts.drop_last
        )
        super().__init__(source, options=opts, collate=collate)

    @property
    def follow_order(self) -> FollowOrder:
        """The order it serves (its :attr:`~streampack.loader.Loader.order`)."""
        return self.dataset.order

    @property
    def follow_options(self) -> FollowOptions:
        """The windows, eras and waiting it was made with."""
        return self.dataset.options

    @property
    def path(self) -> str | os.PathLike[str]:
        """The cache directory or URL."""
        return self.dataset.path

    # Its settings, read as attributes: they are its FollowOptions'.
    seq_len = property(lambda self: self.follow_options.seq_len, doc="Tokens per sample.")
    overlap = property(lambda self: self.follow_options.overlap, doc="Extra tokens per sample.")
    then = property(lambda self: self.follow_options.then, doc="What follows the last era.")
    timeout = property(lambda self: self.follow_options.timeout, doc="Seconds a batch waits at most.")
    poll = property(lambda self: self.follow_options.poll, doc="Seconds between reads of the ledger.")
