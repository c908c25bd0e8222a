"""Framing a batch from its flat ids, every engine's flat ids, and the writer thread's errors.

``frame`` is checked against the plain rule it replaces (per piece: BOS if it opens a document, its ids, EOS
if it ends one), on both of its ways of inserting the ids; ``encode_flat`` against ``encode_batch`` of the
same engine on real text; the writer thread by handing it a write that fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack.builder import blocks as framing
from streampack.builder.blocks import frame
from streampack.builder.pipeline import ENCODING_THREADS
from streampack.builder.writer import Framed, WriterThread
from streampack.errors import WriteError
from streampack.format.ledger import Counts
from streampack.tokenizer.engines import FASTOKENS_CALLS, fastokens_call_threads, joined
from streampack.tokenizer.load import load_tokenizer
from tests.conftest import SAMPLE_CORPUS


def _framed_piece_by_piece(
    pieces: list[np.ndarray], ends_doc: list[bool], opens_doc: bool, bos: int | None, eos: int | None
) -> tuple[list[int], list[int], list[int]]:
    tokens: list[int] = []
    piece_ends: list[int] = []
    opens = opens_doc
    for ids, ends in zip(pieces, ends_doc):
        tokens += ([bos] if opens and bos is not None else []) + ids.tolist()
        tokens += [eos] if ends and eos is not None else []
        piece_ends.append(len(tokens))
        opens = ends
    return tokens, [e for e, ends in zip(piece_ends, ends_doc) if ends], piece_ends


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.lists(st.integers(0, 999), max_size=6), min_size=1, max_size=12),
    ends=st.lists(st.booleans(), min_size=12, max_size=12),
    opens_doc=st.booleans(),
    bos=st.sampled_from([None, 1000]),
    eos=st.sampled_from([None, 1001]),
    joined_runs=st.sampled_from([0, 512]),
)
def test_frame_is_the_piece_by_piece_rule_whichever_way_it_inserts(
    pieces: list[list[int]],
    ends: list[bool],
    opens_doc: bool,
    bos: int | None,
    eos: int | None,
    joined_runs: int,
) -> None:
    arrays = [np.array(p, dtype=np.uint32) for p in pieces]
    ends_doc = ends[: len(arrays)]
    ends_doc[-1] = ends_doc[-1] or len(arrays) == 1
    expected = _framed_piece_by_piece(arrays, ends_doc, opens_doc, bos, eos)
    before, framing._JOINED_RUNS = framing._JOINED_RUNS, joined_runs  # 0: np.insert's way
    try:
        tokens, doc_ends, piece_ends = frame(
            joined(arrays), ends_doc, opens_doc, bos, eos, np.dtype(np.uint16)
        )
    finally:
        framing._JOINED_RUNS = before
    assert tokens.dtype == np.uint16
    assert (tokens.tolist(), doc_ends.tolist(), piece_ends.tolist()) == expected


def _real_texts(limit: int) -> list[str]:
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    with SAMPLE_CORPUS.open("rb") as f:
        lines = zstandard.ZstdDecompressor().stream_reader(f).read().splitlines()[:limit]
    texts = [json.loads(line)["text"] for line in lines]
    return [*texts, "", " ", "héllo 🙂 wörld", "<|endoftext|> as text"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tokenizers", "fastokens"])
def test_every_engines_flat_ids_are_its_per_text_ids_end_to_end(
    engine: str, gpt2_tokenizer: Path, tiktoken_gpt2: Path
) -> None:
    texts = _real_texts(60)
    for spec, chosen in (
        (str(gpt2_tokenizer), engine),
        (f"tiktoken:{tiktoken_gpt2}", engine),
        ("bytes", "auto"),
    ):
        if spec.startswith("tiktoken:") and engine == "tokenizers":
            chosen = "tiktoken"
        tok = load_tokenizer(spec, engine=chosen)  # type: ignore[arg-type]
        flat, offsets = tok.encode_flat(texts)
        per_text = tok.encode_batch(texts)
        assert len(offsets) == len(texts) + 1 and offsets[0] == 0 and offsets[-1] == len(flat), spec
        got = [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(texts))]
        assert got == [ids.tolist() for ids in per_text], (spec, tok.engine.name)
        empty_flat, empty_offsets = tok.encode_flat([])
        assert len(empty_flat) == 0 and empty_offsets.tolist() == [0]


def test_the_fast_engine_divides_its_threads_among_the_builds_concurrent_calls() -> None:
    assert ENCODING_THREADS == FASTOKENS_CALLS == 2
    assert [fastokens_call_threads(n) for n in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 4]


class _FailingWriter:
    """A shard writer whose second append fails as a full disk would."""

    def __init__(self) -> None:
        self.appended = 0

    def append(self, tokens: np.ndarray, ends: np.ndarray, mask: np.ndarray | None) -> None:
        if self.appended == 1:
            raise WriteError("shard.tokens: disk full")
        self.appended += 1

    def commit(self, counts: Counts, *, done: bool = False) -> None:
        raise AssertionError("nothing is committed after a failed write")


class _Unit:
    def __init__(self) -> None:
        self.writer = _FailingWriter()

        class _Run:
            profile = False

        class _Spec:
            run = _Run()

        self.spec = _Spec()


def test_a_failed_write_is_raised_in_the_reading_thread_and_nothing_after_it_is_written() -> None:
    unit = _Unit()
    writer = WriterThread(2)
    framed = [
        Framed(unit, np.ones(3, np.uint16), np.array([3]), None, Counts(1, 0, 0, 0), commit=i == 2)  # type: ignore[arg-type]
        for i in range(3)
    ]
    writer.put(framed[0])
    writer.put(framed[1])
    with pytest.raises(WriteError, match="disk full"):
        writer.drain()
    with pytest.raises(WriteError, match="disk full"):
        writer.put(framed[2])
    assert unit.writer.appended == 1
    writer.stop()  # returns: the thread ends whatever it was handed


def test_stopping_the_writer_drops_what_it_was_handed_and_ends_the_thread() -> None:
    unit = _Unit()
    unit.writer.appended = -100  # never fails
    writer = WriterThread(8)
    for _ in range(5):
        writer.put(Framed(unit, np.ones(3, np.uint16), np.array([3]), None, Counts(1, 0, 0, 0)))  # type: ignore[arg-type]
    writer.stop()
    assert not writer._thread.is_alive()
