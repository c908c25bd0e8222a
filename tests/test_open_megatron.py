"""A Megatron ``.bin`` + ``.idx`` pair opened as a cache: written by our export and by megatron-core's own
``IndexedDatasetBuilder`` (fed by ``tokenizers`` on real text, as ``tools/preprocess_data.py`` does), read
with every streampack view, and refused clearly when damaged."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError, OptionsError
from streampack.testing.caches import write_cache
from tests.conftest import SAMPLE_CORPUS


def texts(limit: int = 400) -> list[str]:
    import orjson
    import zstandard

    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    raw = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")).read()
    return [orjson.loads(line)["text"] for line in raw.splitlines()[:limit]]


def test_an_exported_pair_opens_as_the_same_documents_and_samples(
    natural: streampack.Cache, megatron_export: Path
) -> None:
    """Every document, the stream's windows, packed samples and a Loader's batches equal the native
    cache's; the prefix, ``.bin`` and ``.idx`` name the same pair."""
    opened = streampack.open(megatron_export, eos_id=natural.eos_id)
    assert (opened.num_docs, opened.num_tokens, opened.dtype) == (
        natural.num_docs,
        natural.num_tokens,
        natural.dtype,
    )
    assert opened.eos_id == natural.eos_id and opened.manifest.tokenizer.kind == "undeclared"
    for i in range(natural.num_docs):
        np.testing.assert_array_equal(opened.doc(i), natural.doc(i))
    np.testing.assert_array_equal(opened.doc_lengths(), natural.doc_lengths())
    ours, theirs = opened.sequences(64, overlap=1), natural.sequences(64, overlap=1)
    assert len(ours) == len(theirs)
    rows = np.arange(0, len(ours), 7)
    np.testing.assert_array_equal(ours[rows], theirs[rows])
    np.testing.assert_array_equal(opened.packed(128)[np.arange(50)], natural.packed(128)[np.arange(50)])
    loaders = [streampack.Loader(c.sequences(32), batch_size=8, seed=3) for c in (opened, natural)]
    for a, b, _ in zip(*loaders, range(20), strict=False):
        np.testing.assert_array_equal(a, b)
    for name in (f"{megatron_export}.bin", f"{megatron_export}.idx"):
        assert streampack.open(name).num_docs == natural.num_docs


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # megatron-core's, torch's
def test_a_pair_written_by_megatron_core_opens_with_megatrons_documents(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """``IndexedDatasetBuilder`` fed by ``tokenizers`` (``preprocess_data.py``'s path), with documents of
    one sequence and of several (sentence splitting): streampack's documents are Megatron's documents,
    their sequences end to end, in the int32 dtype ``preprocess_data.py`` picks for a large vocabulary too."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gpt2_tokenizer))
    encoded = [np.array([*e.ids, 50256], dtype=np.int64) for e in tokenizer.encode_batch(texts(200))]
    for dtype in (np.uint16, np.int32):
        prefix = tmp_path / f"theirs-{np.dtype(dtype).name}"
        builder = indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
        for k, ids in enumerate(encoded):
            if k % 3 == 0 and len(ids) > 4:  # a document of two sequences
                half = len(ids) // 2
                builder.add_document(torch.from_numpy(ids), [half, len(ids) - half])
            else:
                builder.add_item(torch.from_numpy(ids))
                builder.end_document()
        builder.finalize(f"{prefix}.idx")
        dataset = indexed.IndexedDataset(str(prefix))
        opened = streampack.open(prefix, eos_id=50256, tokenizer=str(gpt2_tokenizer))
        assert opened.num_docs == len(dataset.document_indices) - 1 == len(encoded)
        for i, ids in enumerate(encoded):
            first, last = dataset.document_indices[i], dataset.document_indices[i + 1]
            theirs = np.concatenate([dataset[j] for j in range(first, last)])
            np.testing.assert_array_equal(opened.doc(i), theirs)
            np.testing.assert_array_equal(opened.doc(i), ids)
        assert opened.dtype == (np.dtype("<u2") if dtype is np.uint16 else np.dtype("<u4"))


def test_a_declared_tokenizer_lets_a_mixture_check_it(
    natural: streampack.Cache,
    megatron_export: Path,
    tmp_path: Path,
    bpe_tokenizer: Path,
    gpt2_tokenizer: Path,
) -> None:
    """Declared the same as the native cache's: they mix; declared another: refused as for two native
    caches; undeclared: mixes (nothing says otherwise)."""
    same = streampack.open(megatron_export, eos_id=50256, tokenizer=str(gpt2_tokenizer))
    assert same.manifest.tokenizer.identity == natural.manifest.tokenizer.identity
    assert same.vocab_size == natural.vocab_size
    streampack.Mixture(
        {"native": natural.sequences(32), "megatron": same.sequences(32)},
        weights={"native": 1, "megatron": 1},
    )
    other = streampack.open(megatron_export, eos_id=50256, tokenizer=str(bpe_tokenizer))
    with pytest.raises(OptionsError, match="different tokenizers"):
        streampack.Mixture(
            {"native": natural.sequences(32), "megatron": other.sequences(32)},
            weights={"native": 1, "megatron": 1},
        )
    undeclared = streampack.open(megatron_export)
    streampack.Mixture(
        {"native": natural.sequences(32), "m": undeclared.sequences(32)}, weights={"native": 1, "m": 1}
    )


def test_options_of_other_formats_are_refused_for_a_native_cache(natural: streampack.Cache) -> None:
    with pytest.raises(OptionsError, match="eos_id apply to other formats' token files"):
        streampack.open(natural.root, eos_id=1)
    with pytest.raises(OptionsError, match="unknown format 'megatronn'"):
        streampack.open(natural.root, format="megatronn")


def test_a_folder_of_nothing_known_says_what_each_format_looks_for(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CacheError, match=r"not a streampack cache \(no manifest.json\) nor .*PREFIX.idx"):
        streampack.open(tmp_path)
    with pytest.raises(CacheError, match="no such cache directory"):
        streampack.open(tmp_path / "missing")


# ----------------------------------------------------------------------------- damaged pairs


@pytest.fixture
def small(tmp_path: Path) -> Path:
    tokens = np.array([5, 6, 9, 7, 9, 1, 2, 3, 9], dtype=np.uint16)
    cache = streampack.open(
        write_cache(tmp_path / "c", [(tokens, np.array([3, 5, 9]))], vocab_size=10, eos_id=9)
    )
    cache.export("megatron", tmp_path / "m")
    return tmp_path / "m"


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: patch(Path(f"{m}.idx"), 0, b"MMIDIDY"), r"m.idx: magic b'MMIDIDY\\x00\\x00', expected"),
        (lambda m: patch(Path(f"{m}.idx"), 9, struct.pack("<Q", 2)), r"m.idx: version 2, expected 1"),
        (lambda m: patch(Path(f"{m}.idx"), 17, struct.pack("<B", 7)), r"m.idx: dtype code 7 \(float32\)"),
        (
            lambda m: patch(Path(f"{m}.idx"), 18, struct.pack("<Q", 4)),
            r"m.idx: .* bytes, but the header, 4 sequences",
        ),
        (
            lambda m: Path(f"{m}.idx").write_bytes(Path(f"{m}.idx").read_bytes()[:20]),
            r"m.idx: 20 bytes, shorter than",
        ),
        (
            lambda m: Path(f"{m}.bin").write_bytes(Path(f"{m}.bin").read_bytes()[:-2]),
            r"m.bin: 16 bytes, but the 9 tokens",
        ),
        (lambda m: Path(f"{m}.bin").unlink(), r"m.bin: missing; it should hold the 9 tokens"),
        (
            lambda m: patch(Path(f"{m}.idx"), HEADER + 12, struct.pack("<q", 8)),
            r"sequence_pointers\[0\] is 8, expected 0",
        ),
        (
            lambda m: patch(Path(f"{m}.idx"), HEADER, struct.pack("<i", -1)),
            r"sequence_lengths\[0\] is -1, below 0",
        ),
        (
            lambda m: patch(Path(f"{m}.idx"), HEADER + 36 + 8, struct.pack("<q", 3)),
            r"document_indices\[2\] decreases",
        ),
        (
            lambda m: patch(Path(f"{m}.idx"), HEADER + 36 + 24, struct.pack("<q", 2)),
            r"document_indices run from 0 to 2, expected 0 to the sequence count 3",
        ),
    ],
    ids=[
        "magic",
        "version",
        "dtype",
        "counts",
        "short-idx",
        "short-bin",
        "no-bin",
        "pointers",
        "lengths",
        "decreasing",
        "last-index",
    ],
)
def test_a_damaged_pair_is_a_cache_error_naming_the_file_and_field(
    small: Path, damage: object, message: str
) -> None:
    assert streampack.open(small).num_docs == 3
    damage(small)  # type: ignore[operator]
    with pytest.raises(CacheError, match=message):
        streampack.open(small)


def test_samples_of_an_opened_pair_reach_dataloader_workers_with_what_was_declared(
    natural: streampack.Cache, megatron_export: Path
) -> None:
    """Pickled samples reopen the pair as it was opened (format, ``eos_id``): in real DataLoader worker
    processes, the batches are the in-process Loader's."""
    import pickle

    torch_data = pytest.importorskip("streampack.torch", reason="the DataLoader part needs torch")
    opened = streampack.open(megatron_export, eos_id=50256)
    samples = opened.sequences(64)
    again = pickle.loads(pickle.dumps(samples))
    assert again.cache.eos_id == 50256 and again.cache.declared == {"eos_id": 50256, "format": "megatron"}
    np.testing.assert_array_equal(again[np.arange(30)], samples[np.arange(30)])
    loader = streampack.Loader(samples, batch_size=8, seed=1)
    workers = torch_data.DataLoader(streampack.Loader(samples, batch_size=8, seed=1), num_workers=2)
    for mine, theirs, _ in zip(loader, workers, range(12), strict=False):
        np.testing.assert_array_equal(theirs.numpy(), mine)


@pytest.mark.slow
def test_verify_checks_every_token_of_a_pair_against_what_was_declared(small: Path) -> None:
    """``streampack verify`` of a pair: ok with the EOS it has; a wrong ``--eos-id`` or a ``--vocab-size``
    below its ids are errors naming the ``.bin``; ``info`` describes it."""
    from tests.conftest import run_cli

    done = run_cli("verify", small, "--eos-id", "9")
    assert done.returncode == 0 and "megatron files: their headers and indexes were checked" in done.stdout
    wrong = run_cli("verify", small, "--eos-id", "5", check=False)
    assert (
        wrong.returncode == 1
        and f"{small}.bin: document 0 (and 2 more) does not end with EOS 5" in wrong.stderr
    )
    low = run_cli("verify", small, "--vocab-size", "8", check=False)
    assert low.returncode == 1 and f"{small}.bin: token 2 is 9, not below the vocab size 8" in low.stderr
    info = run_cli("info", small, "--eos-id", "9")
    assert "num_docs          3" in info.stdout and "undeclared:megatron" in info.stdout
