"""How the loader formats a batch: from the ``(rows, width)`` token array it read to what a step takes:
:class:`Tokens` for ``output="numpy"``, :class:`CausalLMDict` for ``"dict"``, ``"varlen"`` and
``"hf-flash"``. A user's ``collate=`` function, when given, is applied after the format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from streampack.errors import OptionsError
from streampack.order import groups

if TYPE_CHECKING:
    from streampack.loader.domains import Domains
    from streampack.loader.parallel import RankColumns
    from streampack.samples.boundaries import Boundaries

__all__ = ["CausalLMDict", "Format", "Tokens", "format_for"]


class Format(Protocol):
    """Turns a batch's token rows into what the loader yields."""

    def __call__(self, tokens: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> Any:
        """Format ``tokens``, whose row ``k`` is sample ``samples[k]`` of source ``sources[k]``."""
        ...


class Tokens:
    """The token array itself: ``output="numpy"``."""

    def __call__(self, tokens: np.ndarray, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Return ``tokens`` unchanged."""
        return tokens


class CausalLMDict:
    """Batches as Hugging Face causal LMs take them, with no loss across documents: ``output="dict"``.

    Fields, each ``(rows, seq_len)``:

    * ``input_ids``: the tokens, in the loader's dtype.
    * ``labels``: ``int64``; the tokens, except ``-100`` (ignored by the loss) at every document and row
      start, at padding, and on the tokens an SFT cache marks as no target (prompts). The models shift
      labels themselves: a document's first token would be predicted from the previous document.
    * ``position_ids``: ``int64``; 0 at every document and row start, counting up inside a document (a
      row's padding is one more segment), as Hugging Face's ``DataCollatorWithFlattening`` makes them.

    With ``segments="varlen"`` (``output="varlen"``), also:

    * ``cu_seqlens``: ``int32``, ``(segments + 1,)``: where each segment (a document, or its part in a
      row) starts in the flattened batch, then ``rows * seq_len``; its length varies by batch.
    * ``max_seqlen``: ``int``, the longest segment.

    With ``segments="hf-flash"`` (``output="hf-flash"``), the same two under the names of Hugging Face's
    ``FlashAttentionKwargs``: ``cu_seq_lens_q`` and ``cu_seq_lens_k``, ``max_length_q`` and
    ``max_length_k``; the rows stay ``(rows, seq_len)``.

    With ``context_parallel=(cp_size, cp_rank)`` and ``cp_size > 1``, every field is this CP rank's part of
    each row, ``(rows, seq_len / cp_size)`` (:class:`streampack.loader.parallel.RankColumns`), and
    ``cu_seqlens`` its own segments. A piece's fill (``pad_multiple``) counts on in its position ids, with
    labels -100, and is in its segment (TransformerEngine's ``cu_seqlens_padded``). Also:

    * ``shift_labels``: ``int64``, the label of the next token of the full row at each token (``-100``
      after the row's last): a model that shifts ``labels`` itself would pair tokens across the seams of
      the rank's chunks.

    Of a mixture, also ``source_ids`` and, with the ``loss_weights`` option, ``loss_weights``
    (:mod:`streampack.loader.domains`).

    Args:
        sources: the loader's data sources, in source-id order.
        segments: ``None``, or the names to add the segments under: ``"varlen"`` or ``"hf-flash"``.
        context_parallel: ``(cp_size, cp_rank)``; ``(1, 0)`` serves whole rows.
        domains: the per-source keys to add (a mixture's); None: none.

    Raises:
        OptionsError: a source has no ``boundaries()`` method, or its samples overlap; with ``cp_size >
            1``, a source is not whole documents padded to a multiple of ``2 * cp_size``.
    """

    def __init__(
        self,
        sources: Sequence[object],
        *,
        segments: str | None = None,
        context_parallel: tuple[int, int] = (1, 0),
        domains: Domains | None = None,
    ) -> None:
        self.segments = segments
        self.context_parallel = context_parallel
        self.domains = domains
        self._boundaries_of: list[Callable[[np.ndarray], Boundaries]] = []
        output = f"output={segments or 'dict'!r}"  # the option the user gave, in messages
        for data in sources:
            if not hasattr(data, "boundaries"):
                raise OptionsError(
                    f"{output} needs position ids, which {type(data).__name__} does not provide "
                    "(no boundaries() method); use output='numpy' or cache.sequences(...)"
                )
            overlap = int(getattr(data, "overlap", 0))
            if overlap:
                raise OptionsError(
                    f"{output} labels the input tokens themselves (Hugging Face models shift them), so "
                    f"the samples need no overlap (got overlap={overlap}); use cache.sequences(seq_len) with "
                    "overlap=0, or output='numpy' for x/y windows"
                )
            self._boundaries_of.append(data.boundaries)
        if context_parallel[0] > 1:
            from streampack.loader.parallel import check_context_parallel

            check_context_parallel(context_parallel[0], list(sources))

    def __call__(
        self,
        tokens: np.ndarray,
        sources: np.ndarray,
        samples: np.ndarray,
        *,
        masked: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """The dict of ``tokens``; ``masked``, given each document segment's row and document, says which
        get ``labels = -100`` (exclusions in mask mode)."""
        found = self._boundaries(sources, samples, tokens.shape)
        off = None if masked is None else masked(found.starts // tokens.shape[1], found.docs)
        cp_size, cp_rank = self.context_parallel
        part: RankColumns | None = None
        segments: Boundaries | RankColumns = found
        if cp_size > 1:  # this CP rank's columns of every row, made at its size
            from streampack.loader.parallel import RankColumns

            segments = part = RankColumns(tokens, found, off, cp_size, cp_rank)
            batch: dict[str, Any] = {"input_ids": part.input_ids, "labels": part.labels}
        else:
            batch = {"input_ids": tokens, "labels": found.labels(tokens, off)}
        batch["position_ids"] = segments.position_ids
        if self.segments == "varlen":
            batch["cu_seqlens"] = segments.cu_seqlens
            batch["max_seqlen"] = segments.max_seqlen
        elif self.segments == "hf-flash":
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = segments.cu_seqlens
            batch["max_length_q"] = batch["max_length_k"] = segments.max_seqlen
        if part is not None:
            batch["shift_labels"] = part.shift_labels
        if self.domains is not None:  # each weight where its loss is: at the label, or under CP the next one
            self.domains.add(batch, sources, batch["labels"] if part is None else batch["shift_labels"])
        return batch

    def _boundaries(self, sources: np.ndarray, samples: np.ndarray, shape: tuple[int, ...]) -> Boundaries:
        """The boundaries of the batch's rows (of each source's rows, put together for a mixture)."""
        if len(self._boundaries_of) == 1:
            return self._boundaries_of[0](samples)
        starts, docs, marks = [], [], []
        for source, rows in groups(sources):
            found = self._boundaries_of[source](samples[rows])
            columns = shape[1]
            # Row k of this source's batch is row rows[k] of the whole one: move each segment there.
            row_of, column = np.divmod(found.starts, columns)
            starts.append(rows[row_of] * columns + column)
            docs.append(found.docs)
            marks.append((rows, found.marks))
        from streampack.samples.boundaries import Boundaries

        order = np.argsort(np.concatenate(starts), kind="stable")
        mask = None
        if any(m is not None for _, m in marks):
            mask = np.ones(shape, dtype=bool)
            for rows, m in marks:
                if m is not None:
                    mask[rows] = m
        return Boundaries(shape, np.concatenate(starts)[order], np.concatenate(docs)[order], mask)


def format_for(
    output: str,
    sources: Sequence[object],
    context_parallel: tuple[int, int] = (1, 0),
    *,
    domains: Domains | None = None,
) -> Format:
    """The format of ``output`` (already validated), for CP rank ``context_parallel[1]`` of
    ``context_parallel[0]``, with the per-source keys ``domains`` in a dict.

    Raises:
        OptionsError: a dict is asked of sources it does not fit (see :class:`CausalLMDict`).
    """
    if output == "numpy":
        return Tokens()
    segments = None if output == "dict" else output
    return CausalLMDict(sources, segments=segments, context_parallel=context_parallel, domains=domains)
