"""What a :class:`~streampack.follow.Follow` serves of a running build and how it waits."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from streampack._checks import check_choice, check_int
from streampack.errors import OptionsError
from streampack.follow.order import Eras
from streampack.loader.options import BatchKeywords, LoaderOptions, unknown_keyword
from streampack.samples.packing import NO_TARGET, TOO_LONG, NoTarget, TooLong

__all__ = ["FollowKeywords", "FollowLayout", "FollowOptions"]

FollowLayout = Literal["sequences", "packed", "documents"]
# What each layout cuts a document longer than seq_len to by default: what cache.packed/documents do.
_TOO_LONG: dict[str, TooLong] = {"packed": "split", "documents": "truncate"}


@dataclass(frozen=True)
class FollowOptions:
    """What a :class:`Follow` serves of a cache whose build runs, and how it waits; validated on creation.

    Attributes:
        seq_len: tokens per sample.
        overlap: extra tokens at the end of each sample (1 for next-token targets; windows only).
        then: after the last era: ``"epochs"`` of the finished cache, endlessly, or ``"end"``.
        first_era: windows in era 0 (the first batch waits for them).
        largest_era: the size eras grow to by doubling: the shuffle's reach once they are that large.
        timeout: seconds a batch waits without the build committing anything before
            :class:`~streampack.errors.BuildStalledError` (in object storage, more than a unit's build time).
        poll: seconds between two reads of the ledger while waiting.
        local_dir: (object storage) the local copy's directory.
        max_local_bytes: (object storage) the bound on the local copy.
        storage_options: (object storage) passed to the fsspec filesystem.
        prefetch_steps: (object storage) steps ahead whose shards are fetched in the background (8 by
            default; 0: none).
        layout: ``"sequences"`` (windows, the default; or ``"windows"``), ``"packed"`` (whole documents,
            best-fit packed) or ``"documents"`` (one document per sample), whose eras count documents.
        too_long: (whole documents) what to do with a document longer than ``seq_len``: ``"split"``
            (packed's default), ``"truncate"`` (documents' default) or ``"drop"``.
        no_target: (whole documents) ``"keep"`` or ``"drop"`` the pieces with no target token.
        pad_id: (whole documents) the id that fills padding; the cache's EOS id by default, else 0.

    Raises:
        OptionsError: an option is out of range.
    """

    seq_len: int
    overlap: int = 0
    then: Literal["end", "epochs"] = "epochs"
    first_era: int = 1024
    largest_era: int = 65536
    timeout: float = 600.0
    poll: float = 0.2
    local_dir: str | os.PathLike[str] | None = None
    max_local_bytes: int | None = None
    storage_options: Mapping[str, Any] | None = None
    prefetch_steps: int | None = None
    layout: FollowLayout = "sequences"
    too_long: TooLong | None = None
    no_target: NoTarget = "keep"
    pad_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_len", check_int("seq_len", self.seq_len, min=1, max=2**40))
        object.__setattr__(self, "overlap", check_int("overlap", self.overlap, min=0, max=2**40))
        self._check_layout()
        check_choice("then", self.then, ("end", "epochs"))
        if not self.timeout > 0 or not self.poll > 0:
            raise OptionsError(
                f"timeout and poll must be positive seconds (got timeout={self.timeout}, poll={self.poll})"
            )
        eras = Eras(self.first_era, self.largest_era)  # validates; Python ints
        object.__setattr__(self, "first_era", eras.first)
        object.__setattr__(self, "largest_era", eras.largest)

    def _check_layout(self) -> None:
        """Whole-document settings for whole documents only, overlap for windows only; default too_long."""
        layout = "sequences" if self.layout == "windows" else self.layout
        check_choice("layout", layout, ("sequences", "packed", "documents"))
        object.__setattr__(self, "layout", layout)
        if layout == "sequences":
            named = ("too_long", "pad_id")
            given = [f"{name}={getattr(self, name)!r}" for name in named if getattr(self, name) is not None]
            given += [f"no_target={self.no_target!r}"] if self.no_target != "keep" else []
            if given:
                raise OptionsError(
                    f"{', '.join(given)} apply to whole documents, not to windows: give layout='packed' or "
                    "'documents' with them, or leave them out"
                )
            return
        if self.overlap:
            raise OptionsError(
                f"overlap applies to layout='sequences' only, not to {layout!r} (got "
                f"overlap={self.overlap}); whole-document samples have no overlap: leave it out"
            )
        too_long = _TOO_LONG[layout] if self.too_long is None else self.too_long
        check_choice("too_long", too_long, TOO_LONG)
        check_choice("no_target", self.no_target, NO_TARGET)
        object.__setattr__(self, "too_long", too_long)
        if self.pad_id is not None:
            object.__setattr__(self, "pad_id", check_int("pad_id", self.pad_id, min=0, max=2**63 - 1))

    @property
    def whole_documents(self) -> bool:
        """Whether the samples are whole documents (``packed`` or ``documents``)."""
        return self.layout != "sequences"

    @property
    def eras(self) -> Eras:
        """The era sizes (in documents for whole documents, else in windows)."""
        return Eras(self.first_era, self.largest_era)

    @property
    def reading(self) -> dict[str, Any]:
        """The options of a cache in object storage (see :func:`streampack.open`)."""
        names = ("local_dir", "max_local_bytes", "storage_options", "prefetch_steps")
        return {name: getattr(self, name) for name in names}


class FollowKeywords(BatchKeywords, total=False):
    """The keywords of a :class:`Follow`: the fields of :class:`FollowOptions` and its loader's."""

    seq_len: int
    overlap: int
    then: Literal["end", "epochs"]
    first_era: int
    largest_era: int
    timeout: float
    poll: float
    local_dir: str | os.PathLike[str] | None
    max_local_bytes: int | None
    storage_options: Mapping[str, Any] | None
    prefetch_steps: int | None
    layout: FollowLayout
    too_long: TooLong | None
    no_target: NoTarget
    pad_id: int | None


_LOADER_KEYWORDS = {f.name for f in dataclasses.fields(LoaderOptions)} - {"shuffle", "epochs"}
_FOLLOW_KEYWORDS = {f.name for f in dataclasses.fields(FollowOptions)}


def split_keywords(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Follow's keywords: those of its :class:`LoaderOptions`, and those of its :class:`FollowOptions`."""
    unknown = sorted(set(keywords) - _LOADER_KEYWORDS - _FOLLOW_KEYWORDS)
    if unknown:
        raise unknown_keyword("Follow", unknown[0], sorted(_LOADER_KEYWORDS | _FOLLOW_KEYWORDS))
    loading = {k: v for k, v in keywords.items() if k in _LOADER_KEYWORDS}
    return loading, {k: v for k, v in keywords.items() if k in _FOLLOW_KEYWORDS}
