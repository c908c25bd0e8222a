"""Samples of whole documents (best-fit packing, one document per sample) and the held-out split.

Caches here are written with token ``t`` equal to its global index in the stream, so that every token served
says exactly where it came from.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import LoaderStateError, OptionsError
from streampack.samples import PackedSequences, packing
from streampack.testing.caches import write_cache

PAD = 2**32 - 1  # no token of these caches: their ids are their indices


def indexed_cache(root: Path, shards: list[list[int]]) -> streampack.Cache:
    """A cache whose shard ``k`` holds documents of the given lengths, and whose tokens are their indices."""
    pieces, base = [], 0
    for lengths in shards:
        ends = np.cumsum(lengths, dtype=np.int64)
        total = int(ends[-1]) if len(ends) else 0
        pieces.append((np.arange(base, base + total), ends))
        base += total
    write_cache(root, pieces, vocab_size=2**32, eos_id=0)
    return streampack.open(root)


def documents_of(cache: streampack.Cache) -> list[np.ndarray]:
    """Every document's token ids (its global token indices)."""
    starts = np.concatenate([[0], np.cumsum(cache.doc_lengths().astype(np.int64))])
    return [np.arange(starts[d], starts[d + 1]) for d in range(cache.num_docs)]


def served(samples: PackedSequences) -> list[np.ndarray]:
    """The tokens of every sample, padding removed."""
    rows = samples[np.arange(len(samples))]
    return [row[row != samples.pad_id] for row in rows]


def reference_bfd(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing the plain way: each item into the bin with least room that fits it.

    Ties go to the bin whose room last changed (the packer keeps one stack of bins per room value).
    """
    bins: list[list[int]] = []
    room: list[int] = []
    changed: list[int] = []
    for tick, item in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[item]]
        if fits:
            chosen = min(fits, key=lambda b: (room[b], -changed[b]))
        else:
            chosen = len(bins)
            bins.append([])
            room.append(capacity)
            changed.append(0)
        bins[chosen].append(item)
        room[chosen] -= lengths[item]
        changed[chosen] = tick
    return bins


doc_lengths = st.lists(st.integers(1, 90), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(shards=st.lists(doc_lengths, min_size=1, max_size=4), seq_len=st.integers(8, 48))
def test_packing_serves_every_token_once_and_whole_documents_in_one_sample(
    tmp_path_factory: pytest.TempPathFactory, shards: list[list[int]], seq_len: int
) -> None:
    cache = indexed_cache(tmp_path_factory.mktemp("c") / "cache", shards)
    samples = cache.packed(seq_len, pad_id=PAD)
    rows = served(samples)
    assert all(len(row) <= seq_len for row in rows)
    tokens = np.concatenate(rows)
    assert np.array_equal(np.sort(tokens), np.arange(cache.num_tokens))  # each exactly once
    where = np.empty(cache.num_tokens, dtype=np.int64)  # the sample of each token
    for k, row in enumerate(rows):
        where[row] = k
    for doc in documents_of(cache):
        # A document is one run of consecutive ids in one sample, or pieces of seq_len and a remainder.
        pieces = [doc[i : i + seq_len] for i in range(0, len(doc), seq_len)]
        for piece in pieces:
            row = rows[where[piece[0]]]
            at = int(np.flatnonzero(row == piece[0])[0])
            assert np.array_equal(row[at : at + len(piece)], piece)
    # Padding only at the end of a row, and the layout's figure is the real one.
    full = samples[np.arange(len(samples))]
    assert samples.layout.padding == pytest.approx((full == samples.pad_id).mean())


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=120), capacity=st.integers(64, 100))
def test_best_fit_decreasing_matches_the_plain_algorithm(lengths: list[int], capacity: int) -> None:
    expected = reference_bfd(lengths, capacity)
    bin_of = packing._best_fit_decreasing(np.array(lengths, dtype=np.int64), capacity)
    got: list[list[int]] = [[] for _ in range(int(bin_of.max()) + 1)]
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        got[int(bin_of[item])].append(item)
    assert got == expected


def test_packing_is_tighter_than_one_document_per_sample(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    cache = indexed_cache(tmp_path / "c", [rng.integers(1, 200, size=500).tolist()])
    packed, single = cache.packed(256, pad_id=PAD), cache.documents(256, pad_id=PAD)
    assert packed.layout.padding < 0.02 < single.layout.padding
    assert len(packed) < len(single) == cache.num_docs


def test_too_long_documents_follow_the_policy(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [[5, 23, 8], [30]])
    docs = documents_of(cache)
    truncated = cache.documents(10, pad_id=PAD)
    assert [row.tolist() for row in served(truncated)] == [d[:10].tolist() for d in docs]
    dropped = cache.documents(10, too_long="drop", pad_id=PAD)
    assert [row.tolist() for row in served(dropped)] == [docs[0].tolist(), docs[2].tolist()]
    assert dropped.layout.dropped == 2
    split = cache.documents(10, too_long="split", pad_id=PAD)
    expected = [d[i : i + 10].tolist() for d in docs for i in range(0, len(d), 10)]
    assert [row.tolist() for row in served(split)] == expected
    packed = cache.packed(10, too_long="truncate", pad_id=PAD)
    assert sorted(np.concatenate(served(packed)).tolist()) == sorted(
        np.concatenate([d[:10] for d in docs]).tolist()
    )
    with pytest.raises(OptionsError, match="too_long"):
        cache.documents(10, too_long="wrap")  # type: ignore[arg-type]


def test_pieces_without_a_target_are_counted_and_can_be_dropped(tmp_path: Path) -> None:
    """Without a loss mask every token is a target but a piece's first (a segment start, label -100): a
    one-token document or remainder has none."""
    cache = indexed_cache(tmp_path / "c", [[5, 21, 1], [8]])
    docs = documents_of(cache)
    split = cache.documents(10, too_long="split", pad_id=PAD)
    assert split.layout.no_target == 2 and len(split) == 6  # the remainder docs[1][20:] and docs[2]
    kept = cache.documents(10, too_long="split", no_target="drop", pad_id=PAD)
    assert kept.layout.no_target == 2 and len(kept) == 4
    assert [row.tolist() for row in served(kept)] == [
        docs[0].tolist(), docs[1][:10].tolist(), docs[1][10:20].tolist(), docs[3].tolist()
    ]  # fmt: skip
    labels = next(iter(streampack.Loader(kept, batch_size=4, shuffle=False, output="dict")))["labels"]
    assert ((labels != -100).sum(axis=1) > 0).all()
    assert "dropped=0, no_target=2" in repr(streampack.Loader(kept, batch_size=4))
    # Dropping changes the plan, so it is part of its key and fingerprint; keeping is the plan as before.
    assert kept.layout.directory != split.layout.directory
    assert kept.fingerprint()["no_target"] == "drop" and "no_target" not in split.fingerprint()
    packed = cache.packed(10, too_long="split", no_target="drop", pad_id=PAD)
    assert packed.layout.no_target == 2 and packed.layout.tokens == kept.layout.tokens
    wording = r"no_target must be one of 'keep', 'drop' \(got no_target='skip'\)"
    with pytest.raises(OptionsError, match=wording):
        cache.documents(10, no_target="skip")  # type: ignore[arg-type]


def test_padding_is_the_pad_id_and_no_target(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [[3, 4]])
    samples = cache.documents(6, pad_id=7)
    assert samples[0].tolist() == [0, 1, 2, 7, 7, 7] and samples[1].tolist() == [3, 4, 5, 6, 7, 7]
    found = samples.boundaries(np.array([0, 1]))
    assert found.doc_ids.tolist() == [[0, 0, 0, -1, -1, -1], [1, 1, 1, 1, -1, -1]]
    assert found.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    batch = next(iter(streampack.Loader(samples, batch_size=2, shuffle=False, output="varlen")))
    assert batch["labels"].tolist() == [[-100, 1, 2, -100, -100, -100], [-100, 4, 5, 6, -100, -100]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 6, 10, 12] and batch["max_seqlen"] == 4
    assert cache.documents(6).pad_id == 0  # the cache's EOS id
    with pytest.raises(OptionsError, match="pad_id"):
        cache.documents(6, pad_id=-1)


def test_packed_pieces_start_segments(tmp_path: Path) -> None:
    # Documents packed side by side: positions restart at each, labels mask each first token.
    cache = indexed_cache(tmp_path / "c", [[4, 3, 2]])
    samples = cache.packed(9)
    assert len(samples) == 1
    row = samples[0].tolist()
    assert sorted(row) == list(range(9))
    batch = next(iter(streampack.Loader(samples, batch_size=1, output="dict")))
    starts = [i for i in range(9) if row[i] in (0, 4, 7)]  # the documents' first tokens
    assert [i for i in range(9) if batch["position_ids"][0, i] == 0] == starts
    assert [i for i in range(9) if batch["labels"][0, i] == -100] == starts


def test_a_plan_is_stored_beside_the_cache_and_reused(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [list(range(1, 40))])
    first = cache.packed(64)
    stored = list((tmp_path / "c" / "layouts").iterdir())
    assert len(stored) == 1 and first.layout.directory == stored[0]
    again = streampack.open(tmp_path / "c").packed(64)
    assert again.layout.directory == stored[0]
    assert np.array_equal(again[np.arange(len(again))], first[np.arange(len(first))])
    # A copy sent to another process maps the plan again rather than carrying it.
    copy = pickle.loads(pickle.dumps(first))
    assert len(pickle.dumps(first)) < 2000
    assert np.array_equal(copy[np.arange(len(copy))], first[np.arange(len(first))])
    # Other settings make another plan.
    cache.packed(32)
    assert len(list((tmp_path / "c" / "layouts").iterdir())) == 2


def test_a_plan_stays_in_memory_where_it_cannot_be_stored(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [[5, 6, 7]])
    (tmp_path / "c" / "layouts").write_text("not a directory")
    samples = cache.packed(16, pad_id=PAD)
    assert samples.layout.directory is None
    assert sorted(np.concatenate(served(samples)).tolist()) == list(range(18))
    copy = pickle.loads(pickle.dumps(samples))
    assert np.array_equal(copy[0], samples[0])


def test_packed_samples_go_through_the_loader_and_mixtures(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [list(np.random.default_rng(1).integers(1, 30, size=200))])
    packed, windows = cache.packed(32, pad_id=PAD), cache.sequences(32)
    loader = streampack.Loader(packed, batch_size=8, seed=2, epochs=1, drop_last=False)
    seen = np.concatenate([row[row != packed.pad_id] for batch in loader for row in batch])
    assert np.array_equal(np.sort(seen), np.arange(cache.num_tokens))
    # A mixture of layouts of one width: each row comes from its own source, padded or not.
    mix = streampack.Mixture({"packed": packed, "windows": windows}, weights={"packed": 0.5, "windows": 0.5})
    loader = streampack.Loader(mix, batch_size=16, output="dict")
    position = loader.position
    batch = next(iter(loader))
    sources, samples = loader.picks(position)
    for k, (source, sample) in enumerate(zip(sources.tolist(), samples.tolist())):
        expected = (packed if source == 0 else windows)[sample]
        assert batch["input_ids"][k].tolist() == expected.tolist()
        if source == 0:
            assert (batch["labels"][k][expected == packed.pad_id] == -100).all()


def test_packed_samples_in_dataloader_workers(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from streampack.torch import DataLoader

    cache = indexed_cache(tmp_path / "c", [list(np.random.default_rng(2).integers(1, 50, size=300))])
    packed = cache.packed(64)
    batches = list(DataLoader(streampack.Loader(packed, batch_size=4, seed=1, epochs=1), num_workers=2))
    expected = list(streampack.Loader(packed, batch_size=4, seed=1, epochs=1))
    assert len(batches) == len(expected)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(batches, expected))


def test_the_split_holds_out_documents_by_a_stable_hash(tmp_path: Path) -> None:
    lengths = list(np.random.default_rng(3).integers(1, 20, size=2000))
    cache = indexed_cache(tmp_path / "c", [lengths[:700], lengths[700:1200], lengths[1200:]])
    train, validation = cache.split(0.1, seed=4)
    assert 150 < validation.num_docs < 250 and train.num_docs + validation.num_docs == 2000
    held = _docs_served(cache, validation.sequences(1))
    kept = _docs_served(cache, train.sequences(1))
    assert held.isdisjoint(kept) and len(held | kept) == 2000
    # Whole-document layouts of a side hold that side's documents only.
    assert _docs_served(cache, validation.packed(64)) == held
    assert _docs_served(cache, train.documents(64)) == kept
    # Stable when the cache grows: the first 2000 documents keep their side.
    grown = indexed_cache(tmp_path / "g", [lengths[:700], lengths[700:1200], lengths[1200:], [5] * 300])
    assert _docs_served(grown, grown.split(0.1, seed=4)[1].sequences(1)) & set(range(2000)) == held
    # Another seed holds out others; a count holds out exactly that many.
    assert _docs_served(cache, cache.split(0.1, seed=5)[1].sequences(1)) != held
    assert cache.split(37)[1].num_docs == 37


def test_windows_of_a_side_never_reach_the_other(tmp_path: Path) -> None:
    lengths = list(np.random.default_rng(5).integers(1, 40, size=500))
    cache = indexed_cache(tmp_path / "c", [lengths[:250], lengths[250:]])
    train, validation = cache.split(0.2)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    held = _docs_served(cache, validation.sequences(1))
    for side, docs in (
        (train.sequences(16, overlap=1), set(range(500)) - held),
        (validation.sequences(8), held),
    ):
        tokens = side[np.arange(len(side))].reshape(-1)
        owners = set((np.searchsorted(starts, tokens, side="right") - 1).tolist())
        assert owners <= docs
        found = side.boundaries(np.arange(len(side)))
        assert set(found.doc_ids.reshape(-1).tolist()) <= docs


def test_a_checkpoint_of_one_side_does_not_resume_the_other(tmp_path: Path) -> None:
    cache = indexed_cache(tmp_path / "c", [[10] * 400])
    train, validation = cache.split(0.5)
    loader = streampack.Loader(train.sequences(8), batch_size=4)
    next(iter(loader))
    other = streampack.Loader(validation.sequences(8), batch_size=4)
    with pytest.raises(LoaderStateError):
        other.load_state_dict(loader.state_dict())


@pytest.mark.parametrize("holdout", [0, 1.0, -0.5, True, 10**9, "0.1"])
def test_a_bad_holdout_is_refused(tmp_path: Path, holdout: object) -> None:
    cache = indexed_cache(tmp_path / "c", [[3, 3]])
    with pytest.raises(OptionsError, match="holdout"):
        cache.split(holdout)  # type: ignore[arg-type]


def _docs_served(cache: streampack.Cache, samples: PackedSequences) -> set[int]:
    found = samples.boundaries(np.arange(len(samples)))
    docs = set(found.doc_ids.reshape(-1).tolist())
    docs.discard(-1)
    return docs


def test_overwriting_a_cache_removes_its_plans(tmp_path: Path) -> None:
    out = tmp_path / "c"
    streampack.build(streampack.Documents(["one two", "three"]), out, tokenizer="bytes")
    streampack.open(out).packed(16)
    assert (out / "layouts").is_dir()
    streampack.build(streampack.Documents(["four"]), out, tokenizer="bytes", overwrite=True)
    assert not (out / "layouts").exists()
    assert streampack.open(out).packed(16)[0][:4].tolist() == list(b"four")


def test_which_finds_the_lines_of_whole_document_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    texts = ["w" * int(n) for n in rng.integers(1, 300, size=1500)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    streampack.build(source, tmp_path / "c", tokenizer="bytes", unit_bytes=65536)
    cache = streampack.open(tmp_path / "c")
    for samples in (cache.packed(128), cache.documents(128), cache.split(0.2)[1].sequences(64)):
        found = streampack.which(streampack.Loader(samples, batch_size=4, seed=1), step=3)
        assert found
        for doc in found:
            line = int(doc.location.rsplit(":", 1)[1])
            assert doc.length == len(texts[line - 1]) + 1  # its text, then the EOS
            assert cache.doc(doc.doc)[:-1].tolist() == list(texts[line - 1].encode())


@pytest.mark.parametrize("pads", [(PAD, PAD), (PAD, 7)])
def test_loader_batches_of_whole_documents_are_the_samples(tmp_path: Path, pads: tuple[int, int]) -> None:
    # One concatenation per batch (one padding id) or slice copies (two): the same rows either way.
    rng = np.random.default_rng(4)
    a = indexed_cache(
        tmp_path / "a", [rng.integers(1, 90, size=300).tolist(), rng.integers(1, 9, size=40).tolist()]
    )
    b = indexed_cache(tmp_path / "b", [rng.integers(1, 200, size=200).tolist()])
    sources = {"a": a.packed(64, pad_id=pads[0]), "b": b.documents(64, pad_id=pads[1], too_long="split")}
    mix = streampack.Mixture(sources, weights={"a": 0.5, "b": 0.5}, seed=1)
    for dtype in (np.int64, np.uint32):
        loader = streampack.Loader(mix, batch_size=32, dtype=dtype)
        for _, position in zip(range(5), loader.schedule()):
            batch = loader.batch(position)
            names, samples = loader.picks(position)
            for row, name, sample in zip(batch, names.tolist(), samples.tolist()):
                assert row.tolist() == sources["ab"[name]][sample].tolist()


@settings(max_examples=12, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.text("abc \n", min_size=1, max_size=40), st.text("xyz ", min_size=1, max_size=40)),
        min_size=1,
        max_size=30,
    ),
    seq_len=st.integers(8, 64),
    layout=st.sampled_from(["documents", "packed"]),
    too_long=st.sampled_from(["truncate", "split"]),
)
def test_sft_labels_are_ignored_exactly_on_prompts_padding_and_starts(
    tmp_path_factory: pytest.TempPathFactory,
    records: list[tuple[str, str]],
    seq_len: int,
    layout: str,
    too_long: str,
) -> None:
    records = [(p, r) for p, r in records if p.strip() or r.strip()]
    if not records:
        return
    root = tmp_path_factory.mktemp("sft")
    source = root / "sft.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in records))
    streampack.build(source, root / "c", tokenizer="bytes", fields=["prompt", "response"])
    cache = streampack.open(root / "c")
    # What each token is, from the records themselves: a prompt byte, a response byte, or the EOS.
    targets = [[False] * len(p.encode()) + [True] * (len(r.encode()) + 1) for p, r in records]
    assert [cache.doc_loss_mask(d).astype(bool).tolist() for d in range(cache.num_docs)] == targets
    samples = getattr(cache, layout)(seq_len, too_long=too_long)
    loader = streampack.Loader(samples, batch_size=1, shuffle=False, epochs=1, output="dict")
    for index, batch in enumerate(loader):
        found = samples.boundaries(np.array([index]))
        mask = np.zeros(seq_len, dtype=bool)
        for doc, start, stop, column in _pieces_of(samples, index):
            mask[column : column + stop - start] = targets[doc][start:stop]
        ignored = ~mask | (found.position_ids[0] == 0)
        labels = batch["labels"][0]
        assert (labels[ignored] == -100).all()
        assert labels[~ignored].tolist() == batch["input_ids"][0][~ignored].tolist()


def _pieces_of(samples: PackedSequences, index: int) -> list[tuple[int, int, int, int]]:
    """(document, first token in it, one past its last, column) of each piece of sample ``index``."""
    cache = samples.cache
    spans = samples.layout.spans(np.array([index]))
    pieces = []
    for shard, lo, hi, col in zip(
        spans.shards.tolist(), spans.lo.tolist(), spans.hi.tolist(), spans.col.tolist()
    ):
        ends = np.asarray(cache.shard_offsets(shard), dtype=np.int64)
        local = int(np.searchsorted(ends, lo, side="right"))
        start = int(ends[local - 1]) if local else 0
        pieces.append((int(cache.doc_starts[shard]) + local, lo - start, hi - start, col))
    return pieces
