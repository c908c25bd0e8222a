"""Units served at other lengths: the sub-windows a :class:`~streampack.loader.seqlen.SeqLenSchedule` asks
for, and a checkpoint's units taken over by a loader of another ``seq_len``.

The order, the positions and the batches stay those of the units: a batch at length ``l`` is this rank's
units, each cut into its ``k = U / l`` sub-windows, windows ``u*k .. u*k + k - 1`` of the same stream at
``l`` (:mod:`streampack.samples.lengths`). In one batch, because a unit's sub-windows are one contiguous
read, and a step then sees the same tokens at every length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from streampack.errors import OptionsError
from streampack.loader.collate import CausalLMDict, Format, format_for
from streampack.loader.domains import Domains
from streampack.loader.options import LoaderOptions, check_size
from streampack.loader.reading import Source
from streampack.loader.seqlen import SeqLenSchedule
from streampack.order import Order

__all__ = ["Served", "formatted", "own_order"]

Masked = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Served:
    """A loader's units (windows of ``unit`` tokens) served at ``default`` tokens, or at the lengths of
    ``schedule``: a length that divides ``unit`` as each unit's sub-windows, and, with ``joins`` (a resume
    at a longer ``seq_len``), a multiple of it as rows of that many consecutive units.

    Raises:
        OptionsError: the sources are not fixed windows of one length, or a length does not fit it.
    """

    def __init__(
        self,
        sources: list[Source],
        *,
        default: int | None,
        schedule: SeqLenSchedule | None,
        output: str,
        joins: bool = False,
        domains: Domains | None = None,
    ) -> None:
        from streampack.samples.lengths import windows_of

        self._parts = [windows_of(source.data, "seq_len_schedule") for source in sources]
        units = sorted({part.seq_len for part in self._parts})
        if len(units) > 1:
            raise OptionsError(
                f"a seq_len_schedule serves every source's units at one length, but the sources' windows "
                f"have the lengths {units}: read each source with cache.sequences({units[-1]})"
            )
        self.unit, self.overlap = units[0], self._parts[0].overlap
        self.default = self.unit if default is None else default
        self.schedule, self.output, self.domains = schedule, output, domains
        for length in [self.default, *(schedule.lengths if schedule is not None else [])]:
            if self.unit % length and not (joins and length % self.unit == 0):
                raise OptionsError(
                    f"seq_len_schedule serves seq_len {length}, which does not divide the units' length "
                    f"{self.unit} (the windows of cache.sequences({self.unit})): a schedule serves "
                    "sub-windows of windows of its largest length. Read cache.sequences(L) with L the "
                    "largest length, a multiple of every other"
                )
        self._formats: dict[int, Format] = {}

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_formats": {}}  # made again where unpickled

    def length(self, position: int) -> int:
        """The length the batch at ``position`` is served at."""
        return self.default if self.schedule is None else self.schedule.at(position * self.unit)

    def splits(self, position: int) -> bool:
        """Whether the batch at ``position`` is served at another length than its units'."""
        return self.length(position) != self.unit

    @property
    def width(self) -> int:
        """Tokens per row at the default length: ``seq_len + overlap``."""
        return self.default + self.overlap

    def shape(self, position: int, units: int) -> tuple[int, int]:
        """``(rows, width)`` of ``units`` units served at the length of the batch at ``position``."""
        length = self.length(position)
        return units * self.unit // length, length + self.overlap

    def entry(self) -> dict[str, Any]:
        """What a history entry records of it: the default length and the schedule's pairs."""
        return {
            "seq_len": self.default,
            "schedule": None if self.schedule is None else self.schedule.to_json(),
        }

    def batch(
        self,
        position: int,
        picks: tuple[np.ndarray, np.ndarray],
        units: np.ndarray,
        span: tuple[int, int],
        out: np.ndarray | None,
        masking: Masked | None,
    ) -> Any:
        """The formatted batch of the units ``picks`` (their tokens ``units``, at the positions ``span``),
        each as its sub-windows, or joined ``length / unit`` at a time."""
        length = self.length(position)
        if length > self.unit:
            return self._joined(picks, units, span, out, masking, length // self.unit)
        k = self.unit // length
        tokens = _cut(units, k, length, self.overlap, out)
        sources = np.repeat(picks[0], k)
        samples = (picks[1][:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)
        return formatted(self._formatter(length), tokens, (sources, samples), span, masking, k)

    def _joined(
        self,
        picks: tuple[np.ndarray, np.ndarray],
        units: np.ndarray,
        span: tuple[int, int],
        out: np.ndarray | None,
        masking: Masked | None,
        m: int,
    ) -> Any:
        """Rows of ``m`` consecutive units (without overlap), end to end; each unit's start stays a segment
        start (``position_ids`` 0, label -100)."""
        count = len(units) // m
        tokens = _into(units.reshape(count, m * self.unit), out)
        result = formatted(self._formatter(self.unit), units, picks, span, masking)
        if not isinstance(result, dict):
            return tokens
        shaped = {key: v.reshape(count, -1) if np.ndim(v) == 2 else v for key, v in result.items()}
        return shaped | {"input_ids": tokens}

    def _formatter(self, length: int) -> Format:
        """The format of windows of ``length`` (their document boundaries), made once."""
        found = self._formats.get(length)
        if found is None:
            from streampack.samples.lengths import at_seq_len

            parts = [at_seq_len(part, length) for part in self._parts]
            found = format_for(self.output, parts, domains=self.domains)
            self._formats = self._formats | {length: found}  # a new dict: a prefetch thread may read it
        return found


def _cut(units: np.ndarray, k: int, length: int, overlap: int, out: np.ndarray | None) -> np.ndarray:
    """The ``k`` sub-windows of ``length`` (and ``overlap``) of each row of ``units``, row after row: a
    view without overlap, else block copies (the inputs, then each overlap column), into ``out`` if given."""
    count, width = len(units), length + overlap
    if overlap == 0:
        return _into(units.reshape(count * k, length), out)
    if overlap > length:  # each overlap reaches past the next sub-window: cut by strides
        step = units.strides[1]
        cut = np.lib.stride_tricks.as_strided(
            units, (count, k, width), (units.strides[0], length * step, step), writeable=False
        )
        return _into(cut.reshape(count * k, width), out)
    shape = (count * k, width)
    out = np.empty(shape, dtype=units.dtype) if out is None else _checked(out, shape, units.dtype)
    rows = out.reshape(count, k, width)
    rows[:, :, :length] = units[:, : k * length].reshape(count, k, length)
    for t in range(overlap):  # token (j + 1) * length + t of the unit ends sub-window j
        rows[:, :, length + t] = units[:, length + t :: length][:, :k]
    return out


def _into(tokens: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``tokens`` copied into ``out`` when given (checked), else as a new contiguous array."""
    if out is None:
        return np.ascontiguousarray(tokens)
    np.copyto(_checked(out, tokens.shape, tokens.dtype), tokens)
    return out


def _checked(out: object, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out``, checked to be an array of ``shape`` and a dtype that holds ``dtype``."""
    if not isinstance(out, np.ndarray) or out.shape != shape or not np.can_cast(dtype, out.dtype):
        raise ValueError(
            f"out must be a numpy array of shape {shape} and a dtype that holds {dtype} "
            f"(got {type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')})"
        )
    return out


def formatted(
    formatter: Format,
    tokens: np.ndarray,
    picks: tuple[np.ndarray, np.ndarray],
    span: tuple[int, int] | np.ndarray,
    masking: Masked | None,
    rows_a_position: int = 1,
) -> Any:
    """``tokens`` (the rows of ``picks``, ``rows_a_position`` of them for each position of ``span``, a range
    ``[lo, hi)`` or the positions themselves) formatted, with the labels ``masking`` names masked."""
    sources, samples = picks
    if masking is None or not isinstance(formatter, CausalLMDict):
        return formatter(tokens, sources, samples)
    positions = np.arange(*span, dtype=np.int64) if isinstance(span, tuple) else span
    at = np.repeat(positions, rows_a_position)
    return formatter(tokens, sources, samples, masked=lambda r, d: masking(at, sources, r, d))


def own_order(options: LoaderOptions, source: Source) -> Order:
    """The order a loader makes of one source from its options ``seed``, ``shuffle`` and ``epochs``.

    Raises:
        OptionsError: the source holds no batch to iterate.
    """
    from streampack.order.blockshuffle import single_order

    check_size(options, len(source))
    o = options
    return single_order(len(source), seed=o.seed, shuffle=o.shuffle, epochs=o.epochs, data=source.fingerprint)
