"""The settings of a :class:`~streampack.loader.Loader`: one frozen :class:`LoaderOptions`, validated on
creation. ``Loader(source, batch_size=32)`` is ``Loader(source, options=LoaderOptions(batch_size=32))``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, get_args

import numpy as np
import numpy.typing as npt

from streampack._checks import check_bool, check_choice, check_int, check_int_or_none
from streampack.errors import OptionsError
from streampack.loader.seqlen import SeqLenSchedule

if TYPE_CHECKING:
    from streampack.order.blockshuffle import BlockShuffle

__all__ = [
    "Balance",
    "BatchKeywords",
    "LoaderKeywords",
    "LoaderOptions",
    "Output",
    "SourceShare",
    "check_dtype",
    "check_size",
    "unknown_keyword",
    "with_keywords",
]

Output = Literal["numpy", "dict", "varlen", "hf-flash"]
Balance = Literal["rows", "attention"]

_Options = TypeVar("_Options")


@dataclass(frozen=True)
class LoaderOptions:
    """Settings of a :class:`~streampack.loader.Loader`, validated on creation.

    Attributes:
        batch_size: the GLOBAL batch size ``B``: rows of one step summed over all ranks.
        seed: shuffle seed, an integer in ``[0, 2**64)``. Like ``shuffle`` and ``epochs``, it sets the order
            the Loader makes for one dataset; an order given (``order=``, a Mixture) has its own.
        shuffle: ``True``: visit samples in a seeded random order that changes every epoch; ``False``: in
            stream order; a :class:`~streampack.order.blockshuffle.BlockShuffle`: shuffled blocks of
            consecutive samples, mixed within windows of blocks (for caches read from object storage).
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of ranks; it must divide ``batch_size``.
        drop_last: drop the partial last global batch of a run that ends; else serve it, split as evenly
            as possible over the ranks (refused when it has fewer rows than ranks).
        epochs: end the run after this many epochs of the dataset; ``None`` runs forever.
        output: ``"numpy"``, one ``(rows, seq_len + overlap)`` array per step; ``"dict"``, the
            ``input_ids`` / ``labels`` / ``position_ids`` arrays Hugging Face causal LMs take (samples
            without overlap); ``"varlen"``, the same plus ``cu_seqlens`` and ``max_seqlen``; or
            ``"hf-flash"``, those under the names of Hugging Face's flash-attention path. Field by field:
            :class:`streampack.loader.collate.CausalLMDict`.
        dtype: integer dtype of the token arrays; ``None`` keeps the cache dtype.
        seq_len_schedule: the sequence length from each token of the run on, a
            :class:`~streampack.loader.seqlen.SeqLenSchedule` or its ``(first token, seq_len)`` pairs:
            the samples (``cache.sequences(U)``, ``U`` the largest length) are *units*, each served at
            length ``l`` as its ``U / l`` sub-windows in the same batch (the same tokens at every length).
            ``None``: every batch at ``U``.
        cp_size: context-parallel ranks that share each row (``rank`` and ``world_size`` then count the
            data-parallel ranks), each taking ``seq_len / cp_size`` tokens of every row
            (:mod:`streampack.loader.parallel`). Needs a dict ``output`` and samples of
            ``cache.packed(seq_len, pad_multiple=2 * cp_size)`` (or ``cache.documents``).
        cp_rank: this process's context-parallel rank, in ``[0, cp_size)``.
        balance: how a global batch's rows are spread over the data-parallel ranks: ``"rows"``, rank ``r``
            takes the ``r``-th contiguous slice; ``"attention"``, as many rows each, assigned so that the
            ranks' attention costs (sum of squared document lengths) are even (needs samples with
            document boundaries, such as a cache's).
        loss_weights: source name -> weight (a finite number >= 0) of the loss of that source's tokens, for
            a loader of several named sources with a dict ``output``: batches then carry ``loss_weights``
            (:mod:`streampack.loader.domains`; 1.0 for a source not named). A resume may change it.

    Raises:
        OptionsError: (a ``ValueError``) an option is out of range or of the wrong type, or
            ``batch_size`` does not divide by ``world_size``.
    """

    batch_size: int
    seed: int = 0
    shuffle: bool | BlockShuffle = True
    rank: int = 0
    world_size: int = 1
    drop_last: bool = True
    epochs: int | None = None
    output: Output = "numpy"
    dtype: npt.DTypeLike = np.int64
    seq_len_schedule: SeqLenSchedule | Sequence[Sequence[int]] | None = None
    cp_size: int = 1
    cp_rank: int = 0
    balance: Balance = "rows"
    loss_weights: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        # Stored as Python ints: numpy integers (seeds from np.random, sizes from arrays) would make
        # state_dict() fail to serialize as JSON.
        batch_hint = "the global batch size, over all ranks"
        checked = {
            "batch_size": check_int("batch_size", self.batch_size, min=1, max=2**62, hint=batch_hint),
            "world_size": check_int("world_size", self.world_size, min=1, max=2**31),
            "rank": check_int("rank", self.rank, min=0, below=int(self.world_size)),
            "seed": check_int("seed", self.seed, min=0, below=2**64),
            "epochs": check_int_or_none("epochs", self.epochs, min=1, max=2**63, hint="None loops forever"),
            "cp_size": check_int("cp_size", self.cp_size, min=1, max=2**20, hint="context-parallel ranks"),
            "cp_rank": check_int("cp_rank", self.cp_rank, min=0, below=int(self.cp_size)),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.shuffle is not True:  # a BlockShuffle (or a mistake): its module says which
            from streampack.order.blockshuffle import check_shuffle

            check_shuffle(self.shuffle)
        check_bool("drop_last", self.drop_last)
        object.__setattr__(self, "seq_len_schedule", SeqLenSchedule.of(self.seq_len_schedule))
        if self.batch_size % self.world_size:
            smaller = self.batch_size // self.world_size * self.world_size
            suggestion = f"{smaller} or {smaller + self.world_size}" if smaller else str(self.world_size)
            raise OptionsError(
                f"batch_size is the global batch size, split evenly over the ranks: batch_size="
                f"{self.batch_size} does not divide by world_size={self.world_size}. Use a multiple of "
                f"{self.world_size}, e.g. {suggestion}."
            )
        check_choice("output", self.output, get_args(Output))
        check_choice("balance", self.balance, get_args(Balance))
        if self.cp_size > 1 and self.output == "numpy":
            raise OptionsError(
                f"cp_size={self.cp_size} splits rows by their segments and serves each token's position id "
                "and label with it: use output='dict', 'varlen' or 'hf-flash' (got output='numpy')"
            )
        if self.dtype is not None:
            dtype = np.dtype(self.dtype)
            if dtype.kind not in "iu":
                raise OptionsError(
                    f"dtype must be an integer dtype such as int64, or None (got dtype={dtype})"
                )
            object.__setattr__(self, "dtype", dtype)
        if self.loss_weights is not None:
            object.__setattr__(self, "loss_weights", _checked_loss_weights(self.loss_weights))

    @property
    def rows(self) -> int:
        """Rows of a full batch on one rank: ``batch_size // world_size``."""
        return self.batch_size // self.world_size


class BatchKeywords(TypedDict, total=False):
    """The fields of :class:`LoaderOptions` but the order's (``shuffle``, ``epochs``): a Follow's."""

    batch_size: int
    seed: int
    rank: int
    world_size: int
    drop_last: bool
    output: Output
    dtype: npt.DTypeLike
    seq_len_schedule: SeqLenSchedule | Sequence[Sequence[int]] | None
    cp_size: int
    cp_rank: int
    balance: Balance
    loss_weights: Mapping[str, float] | None


class LoaderKeywords(BatchKeywords, total=False):
    """The fields of :class:`LoaderOptions` as keywords: ``Loader(source, batch_size=32)`` type-checked."""

    shuffle: bool | BlockShuffle
    epochs: int | None


@dataclass(frozen=True)
class SourceShare:
    """Where one source of a run stands at a position: what :meth:`Loader.realised` reports.

    Attributes:
        name: the source's name.
        weight: its share of the blocks in force at the position (1.0 for a single dataset).
        served: samples of it served since the run started.
        share: ``served`` divided by the position: the realised proportion.
        size: its samples per epoch.
        epoch: ``served / size``: the epoch it is in, with the fraction of it done.
    """

    name: str
    weight: float
    served: int
    share: float
    size: int
    epoch: float


def _checked_loss_weights(weights: object) -> dict[str, float]:
    """``loss_weights`` as a dict of name -> float, each finite and >= 0."""
    if not isinstance(weights, Mapping):
        raise OptionsError(
            f"loss_weights takes a dict of source name -> weight, e.g. {{'code': 2.0}} (got "
            f"{type(weights).__name__})"
        )
    checked = {}
    for name, weight in weights.items():
        if not isinstance(name, str) or isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise OptionsError(
                f"loss_weights maps source names to numbers (got {name!r}: {weight!r}); e.g. {{'code': 2.0}}"
            )
        if not math.isfinite(weight) or weight < 0:
            raise OptionsError(
                f"loss_weights[{name!r}] must be a finite number >= 0 (got {weight!r}); 0 trains nothing on "
                "that source's tokens, 1 is the usual loss"
            )
        checked[name] = float(weight)
    return checked


def with_keywords(cls: type[_Options], options: _Options | None, keywords: Mapping[str, Any]) -> _Options:
    """``options`` with the fields named in ``keywords`` replaced (validated again), or made of them."""
    if options is None:
        return cls(**keywords)
    return dataclasses.replace(options, **keywords) if keywords else options  # type: ignore[type-var]


def unknown_keyword(what: str, name: str, names: Collection[str]) -> TypeError:
    """The error for a keyword ``what`` does not take, naming the nearest of ``names``."""
    import difflib  # only to word an error

    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(
        f"{what}() got an unexpected keyword argument {name!r}{hint} (its options: {', '.join(names)})"
    )


def check_size(options: LoaderOptions, n: int) -> None:
    """Refuse a dataset of ``n`` samples that holds no batch to iterate."""
    if n == 0 or (options.drop_last and n < options.batch_size):
        raise OptionsError(
            f"the dataset has {n} samples, fewer than one global batch of {options.batch_size}: nothing "
            "to iterate. Use a smaller batch_size or seq_len, a larger cache"
            + (", or drop_last=False." if n else ".")
        )


def check_dtype(
    options: LoaderOptions, dtypes: Sequence[np.dtype], vocab_sizes: Sequence[int | None]
) -> None:
    """Refuse an output ``dtype`` that cannot hold every id of sources of these ``dtypes``.

    A narrower ``dtype`` is allowed where the source's vocabulary fits it (int32 for cl100k's 100,277
    ids); the loader then checks every batch's ids as it casts them, since another format's files are only
    declared to keep to their vocabulary.
    """
    if options.dtype is None:
        return
    for dtype, vocab in zip(dtypes, vocab_sizes, strict=True):
        if np.can_cast(dtype, options.dtype):
            continue
        top = int(np.iinfo(options.dtype).max)
        if vocab is not None and vocab - 1 <= top:
            continue
        why = (
            f": the vocabulary has {vocab:,} ids, and {options.dtype} holds at most {top:,}"
            if vocab is not None
            else " (the source has no vocabulary size to say that its ids fit)"
        )
        raise OptionsError(
            f"dtype={options.dtype} cannot hold every id of the cache's {dtype} tokens{why}; use "
            "int64 (the default), a wider integer type, or None to keep the cache dtype"
        )
