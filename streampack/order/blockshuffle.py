"""A locality-aware shuffle: shuffled blocks of consecutive samples, mixed within windows of blocks.

A global shuffle lets any sample follow any other, so a reader of a cache in object storage needs the
whole cache local, or one request per sample. :class:`BlockShuffled` bounds what a reader needs:

* **Blocks** of ``block`` consecutive sample ids (the last one shorter when ``block`` does not divide
  ``n``): one byte range of the cache to fetch, two where it crosses a shard boundary.
* **Block order**: each epoch visits the blocks in the order of a seeded
  :class:`~streampack.order.permutation.Permutation`; the short block takes a seeded slot of its own.
* **Windows** of ``window`` consecutive blocks of that order: the samples of a window are served in the
  order of a full permutation of them.

So ``window * block`` consecutive positions of an epoch hold the samples of at most ``2 * window``
blocks (``3 * window`` when ``block`` does not divide ``n``): a reader that keeps the current and the
next window local rarely misses. Blocks hold a fixed number of samples, not one shard each, because
finding a position's window needs equal blocks; the default 4096 samples is 16 MB at seq_len 2048 with
uint16 tokens, a good size for one object-storage range request.

Trade-off: a sample only follows samples of its own window, so a batch mixes ``window`` stretches of the
corpus. For a corpus stored by domain (or source, or date), a batch's mix of domains drifts from the
corpus' mix when the window is small (``benchmarks/bench_shuffle_quality.py`` measures it). Shuffle the
inputs before building when that matters, or widen the window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from streampack._checks import check_int
from streampack.errors import LoaderStateError, OptionsError
from streampack.order import OneSource, Shuffled, check_same, derive, groups, kept
from streampack.order.permutation import Permutation

__all__ = ["BlockShuffle", "BlockShuffled", "check_shuffle", "shuffle_fingerprint", "single_order"]


@dataclasses.dataclass(frozen=True)
class BlockShuffle:
    """How to block-shuffle: the ``shuffle=`` of a :class:`~streampack.loader.Loader` or Mixture.

    Example::

        loader = Loader(cache.sequences(2048), batch_size=32, shuffle=BlockShuffle(block=4096, window=32))

    Attributes:
        block: samples per block: consecutive sample ids, one byte range of the cache.
        window: blocks whose samples are shuffled together; a reader needs about ``2 * window * block``
            samples local. A window of every block shuffles each epoch as a whole.

    Raises:
        OptionsError: (a ``ValueError``) ``block`` or ``window`` is not a positive integer.
    """

    block: int = 4096
    window: int = 32

    def __post_init__(self) -> None:
        for name in ("block", "window"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), min=1, max=2**40))


def check_shuffle(shuffle: object) -> None:
    """Refuse a ``shuffle=`` that is not ``True``, ``False`` or a :class:`BlockShuffle`.

    Raises:
        OptionsError: it is anything else (``1``, ``"blocks"``, ``None``).
    """
    if not isinstance(shuffle, (bool, BlockShuffle)):
        raise OptionsError(
            f"shuffle must be True, False or a BlockShuffle(block=..., window=...) (got shuffle={shuffle!r})"
        )


def shuffle_fingerprint(shuffle: bool | BlockShuffle) -> bool | dict[str, int]:
    """``shuffle`` as a checkpoint records it: ``True``, ``False`` or ``{"block": b, "window": w}``."""
    if isinstance(shuffle, BlockShuffle):
        return {"block": shuffle.block, "window": shuffle.window}
    return shuffle


def single_order(
    size: int,
    *,
    seed: int,
    shuffle: bool | BlockShuffle,
    epochs: int | None = None,
    data: Mapping[str, Any] | None = None,
    name: str = "data",
) -> Shuffled | BlockShuffled:
    """The order of one source: :class:`BlockShuffled` for a :class:`BlockShuffle`, else :class:`Shuffled`."""
    if isinstance(shuffle, BlockShuffle):
        return BlockShuffled(
            size, seed=seed, block=shuffle.block, window=shuffle.window, epochs=epochs, data=data, name=name
        )
    return Shuffled(size, seed=seed, shuffle=shuffle, epochs=epochs, data=data, name=name)


@dataclasses.dataclass(frozen=True)
class _Epoch:
    """One epoch's block order, and the slot of its short block."""

    blocks: Permutation | None  # slot (among the full blocks' slots) -> full block
    short: int  # the number of blocks when there is none


class BlockShuffled(OneSource):
    """One source read epoch after epoch in block-shuffled order (see the module docstring).

    Args:
        size: samples per epoch, ``n``.
        seed: shuffle seed, an integer in ``[0, 2**64)``.
        block: samples per block.
        window: blocks per window.
        epochs: end the stream after this many epochs; ``None`` for an endless one.
        data: the data's fingerprint, which a checkpoint is checked against.
        name: the source's name in reports.
    """

    resumes: tuple[str, ...] = ("blocks",)

    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        block: int = 4096,
        window: int = 32,
        epochs: int | None = None,
        data: Mapping[str, Any] | None = None,
        name: str = "data",
    ) -> None:
        BlockShuffle(block, window)  # validates
        check_int("size", size, min=1, hint="a block-shuffled source needs at least one sample")
        super().__init__(size, seed=seed, epochs=epochs, data=data, name=name)
        self.block, self.window = block, window
        self.num_blocks = -(-size // block)
        self.num_windows = -(-self.num_blocks // window)
        self._full = size // block  # blocks of ``block`` samples; one more, shorter, when ragged
        self._missing = self.num_blocks * block - size  # samples the short block lacks (0: none)
        self._seeds = {tag: derive(seed, f"block-shuffle:{tag}") for tag in ("blocks", "short", "windows")}
        self._epochs: dict[int, _Epoch] = {}

    def __repr__(self) -> str:
        return (
            f"BlockShuffled({self.size}, seed={self.seed}, block={self.block}, window={self.window}, "
            f"epochs={self.epochs})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_epochs": {}}

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids at ``positions``."""
        epochs, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.size)
        out = np.empty_like(offsets)
        for epoch, mine in groups(epochs):
            out[mine] = self._epoch_samples(epoch, offsets[mine])
        return out

    def _epoch(self, epoch: int) -> _Epoch:
        """The block order of ``epoch``; the last two are kept."""
        cached = self._epochs.get(epoch)
        if cached is not None:
            return cached
        blocks = Permutation(self._full, seed=self._seeds["blocks"], epoch=epoch) if self._full else None
        short = self.num_blocks
        if self._missing:
            short = Permutation(self.num_blocks, seed=self._seeds["short"], epoch=epoch)(0)
        self._epochs = kept(self._epochs, epoch, _Epoch(blocks, short))
        return self._epochs[epoch]

    def _epoch_samples(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        """Sample ids at ``offsets`` (positions within ``epoch``)."""
        order, b, w = self._epoch(epoch), self.block, self.window
        span = w * b
        # The window holding the short block is ``missing`` samples shorter, so the later ones start
        # that much earlier.
        missing = self._missing
        short_window = order.short // w if missing else -1
        windows = offsets // span
        later = offsets >= (short_window + 1) * span - missing
        windows[later] = (offsets[later] + missing) // span
        starts = windows * span - np.where(windows > short_window, missing, 0)
        local = offsets - starts
        # Within a window, index u < (its full blocks) * b is sample u % b of its (u // b)-th full block
        # in slot order; the short block's samples come after them.
        units = np.empty_like(local)
        for window, mine in groups(windows):
            blocks_in = min(w, self.num_blocks - window * w)
            size = blocks_in * b - (missing if window == short_window else 0)
            key = epoch * self.num_windows + window
            units[mine] = Permutation(size, seed=self._seeds["windows"], epoch=key)(local[mine])
        has_short = windows == short_window
        full_in = np.minimum(w, self.num_blocks - windows * w) - has_short
        in_short = units >= full_in * b
        slots = windows * w + units // b
        slots += has_short & (slots >= order.short)  # skip over the short block's slot
        within = units % b
        slots[in_short] = order.short
        within[in_short] = units[in_short] - full_in[in_short] * b
        blocks = np.full_like(slots, self._full)  # the short block is the last one
        full = ~in_short
        if order.blocks is not None and full.any():
            blocks[full] = order.blocks(slots[full] - (slots[full] > order.short))
        return blocks * b + within

    def fingerprint(self) -> dict[str, Any]:
        """Kind, seed, block, window and the data's fingerprint; the number of epochs only ends the stream."""
        return {
            "kind": "blocks",
            "seed": self.seed,
            "block": self.block,
            "window": self.window,
            "data": dict(self.data),
        }

    def resumed(self, saved: Mapping[str, Any], position: int) -> BlockShuffled:
        """This order, once the checkpoint is checked to have the same seed, block, window and data.

        Raises:
            LoaderStateError: the checkpoint was saved over another order, or with other settings or data.
        """
        kind = saved.get("kind")
        if kind == "shuffled":
            how = "a global shuffle" if saved.get("shuffle") is True else "stream order (shuffle=False)"
            raise LoaderStateError(
                f"the checkpoint was saved by a loader reading in {how}, this loader block-shuffles "
                f"(block={self.block}, window={self.window}); resume it with "
                f"shuffle={saved.get('shuffle')!r}"
            )
        if kind != "blocks":
            raise LoaderStateError(
                f"the checkpoint was saved by a loader over a {kind!r} order, this loader reads one dataset "
                "in block-shuffled order; resume it with the same kind of loader"
            )
        check_same(saved, self.fingerprint(), ("seed", "block", "window", "data"))
        return self
