"""Every export format against a model of it: export, then open, gives the source's documents.

Hypothesis writes real native caches (:func:`streampack.testing.write_cache`, then the manifest's EOS, BOS
and loss mask set, and the ``.mask`` files written, as a build writes them): uint16 and uint32 vocabularies
(65,500 ids: where Megatron's optimal dtype turns int32); documents that end with an EOS, start with a BOS,
both (two ids, or one id as both, as ``bos_id=`` the EOS builds), or neither; with or without a loss mask
(0 at every BOS, 1 at every EOS); in one to four shards, some empty; 1-token documents, documents longer
than an export's shard, and now and then no document at all, or a parse-mode (or chat) build's
documents, which may hold the EOS and BOS ids inside them too. Each case is exported in one format with
options drawn for it (dtypes, shard and file sizes, ``seq_len``, ``val``, ``drop_loss_mask``), with the
buffers the writers and readers cut their work into sometimes made a few tokens small (:data:`BUFFERS`),
so that every cut falls inside the case. Then, as the format's model (``model_*``) says:

* the export (or opening what it wrote) is refused with a :class:`~streampack.errors.StreampackError` of
  the model's class whose message names the cause, and a refused export leaves no file; or
* ``streampack.open(dest, <what the files do not record>)`` gives exactly the model's documents (and loss
  mask), token for token, warns about boundaries exactly where the model says, and ``streampack.verify``
  of the files with the same declaration passes; and ``streampack convert`` of them makes a native cache
  (in shards of a drawn size) that ``verify`` passes and that holds the same documents and mask.

``test_an_export_of_an_export_...`` exports the opened files again, in any format: the result is the second
format's model of what the first's model reads (another format's files, with the vocabulary declared or
their dtype's). hf has no reader: its rows are read with pyarrow. A real cl100k SFT build goes through the
CLI (``export``, ``convert``, ``verify`` in subprocesses) and to the other ecosystems' own readers.

**The model of each format** (``D``: the cache's documents, with their BOS and EOS; ``S``: their stream).
Files that record no EOS or BOS are opened with the cache's ids, except those of a parse-mode cache (they
stand inside its documents too, where ``verify`` rightly refuses a declared EOS or BOS: the files are then
opened with none); a format that finds documents at an id (llmc, nanogpt, olmo) cuts a document at each
one it holds inside, as that ecosystem's readers do.

=========== ========================================================================================
megatron    ``D`` (opened with ``eos_id``/``bos_id``: the files record neither). ``dtype="optimal"``
            writes uint16 below 65,500 ids, else int32, read back as uint32. Refused: a loss mask
            (unless ``drop_loss_mask``: then ``D`` without it, as in every format without masks);
            ``dtype="uint16"`` for more than 65,536 ids; int32 for more than 2**31 ids (another format's
            uint32 files whose vocabulary is undeclared), naming ``vocab_size=``.
llmc        each document written as ``[delimiter] + body``: the delimiter is the BOS where the cache has
            one (the body: the document less its EOS), else the EOS (the body: the document less its
            EOS, the stream shifted by one). That stream is cut into shards of ``shard_tokens``; a reader
            starts a document at each delimiter and at each shard's start, so a document cut by a
            shard's end is read as two (and a shard without a delimiter is said to be one, with a
            ``DocumentBoundaryWarning``). Opened as they are (the headers record the delimiter).
            Refused: a loss mask; a cache with neither EOS nor BOS; a cache without tokens (llm.c's
            reader takes neither a folder without shards nor a shard without tokens).
nanogpt     ``S`` in ``train.bin`` (with ``val``: the documents not held out, in order, and the held-out
            ones, as ``Cache.split`` chooses them, in ``val.bin``), opened with ``eos_id`` (and
            ``dtype="uint32"`` after ``dtype="cache"`` of a uint32 cache). Refused: a loss mask; a
            cache without an EOS, and one whose BOS is its EOS (the files keep boundaries as EOS ids
            alone: they would be lost, or each BOS would end a document); more than 65,536 ids with
            ``dtype="uint16"``; a ``val`` count above the documents.
datatrove   ``D`` and the mask (opened with ``eos_id``/``bos_id``); an empty cache is one empty ``.ds``
            file, which reads back empty. Nothing refused.
olmo        ``D`` and the mask (``olmo.json`` records the EOS, BOS, dtype and vocabulary). Refused: a cache
            without an EOS, and one whose BOS is its EOS (OLMo-core ends a document at each EOS id). An
            empty cache reads back without a loss mask (no file says there is one). A parse-mode cache
            whose documents hold the EOS is left out: it reads back cut and fails verify, a finding
            (``test_olmo_export_of_documents_that_hold_their_eos``, xfail).
hf          no reader (opening the folder is a ``CacheError``). Its rows, read with pyarrow: ``D`` as
            ``input_ids``, and with a mask ``labels``: the ids, -100 at each first token and where the
            mask is 0; or with ``seq_len=L`` the windows ``S[i*L:(i+1)*L]`` (position ids counted from
            each document's or window's start; a label is its id, or -100 at a first token or a masked
            one), or with ``packed`` the samples of ``Cache.packed(L)``. Nothing refused.
mds         ``D`` (opened with ``eos_id``/``bos_id``), or with ``seq_len=L`` the ``len(S) // L`` windows
            ``S[i*L:(i+1)*L]``, each read as one document (the partial tail is not written). Refused: a
            loss mask.
streampack  ``D`` and the mask, in shards of at most ``shard_tokens``. Nothing refused.
=========== ========================================================================================
"""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError, DocumentBoundaryWarning, OptionsError, StreampackError
from streampack.format.names import checksum_text, ledger_key, mask_path, shard_name, with_checksum
from streampack.format.sections import BosPolicy, BuildSettings, EosPolicy
from streampack.interop import convert, hf, native, writing
from streampack.reader.foreign import nanogpt, scanning
from streampack.store import encode_json
from streampack.store.files import load_manifest, write_manifest
from streampack.testing import write_cache
from tests.conftest import run_cli

PROPERTY = settings(
    max_examples=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHAINS = settings(PROPERTY, max_examples=200)  # 49 pairs of formats

# ----------------------------------------------------------------------------- source caches

#: Vocabulary sizes: uint16 ones (65,500 is where Megatron's optimal dtype turns int32) and uint32 ones.
VOCABS = [300, 50257, 65500, 65536, 100277, 1 << 20]
POLICIES = ["eos", "bos", "both", "same", "none"]  # same: one id is the BOS and the EOS


@dataclass(frozen=True)
class Source:
    """A cache: its policies, and each shard's documents (with their BOS and EOS) and loss masks; one to
    write as a native cache, or what opening an export reads (``model_*``'s :attr:`Reads.source`)."""

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    shards: list[list[np.ndarray]]
    masks: list[list[np.ndarray]] | None
    wide: bool = False  # its tokens are uint32
    continued: bool = False  # a document may lack the BOS: the rest of one an llm.c shard's end cut
    inside: bool = False  # the EOS and BOS ids may stand inside documents (a parse-mode or chat build)

    @property
    def docs(self) -> list[np.ndarray]:
        return [doc for shard in self.shards for doc in shard]

    @property
    def doc_masks(self) -> list[np.ndarray] | None:
        return None if self.masks is None else [m for shard in self.masks for m in shard]

    @property
    def stream(self) -> np.ndarray:
        return stream_of(self.docs)

    def declared(self) -> dict[str, int]:
        """What ``streampack.open`` is told of files that record neither the EOS nor the BOS: the ids that
        stand at every document's end and start (a BOS some documents lack is not declared)."""
        if self.inside:  # ids that stand inside documents too delimit none: verify rightly refuses them
            return {}
        bos = None if self.continued else self.bos_id
        return {
            name: value for name, value in (("eos_id", self.eos_id), ("bos_id", bos)) if value is not None
        }

    def __repr__(self) -> str:  # what hypothesis prints of a failing case
        shards = [[d.tolist() for d in shard] for shard in self.shards]
        masks = None if self.masks is None else [[m.tolist() for m in shard] for shard in self.masks]
        return (
            f"Source(vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id}, "
            f"shards={shards}, masks={masks}, wide={self.wide}, continued={self.continued}, "
            f"inside={self.inside})"
        )


@st.composite
def sources(draw: st.DrawFn) -> Source:
    """A source cache: its vocabulary, EOS and BOS policy, shards of documents, and maybe a loss mask."""
    vocab = draw(st.sampled_from(VOCABS))
    policy = draw(st.sampled_from(POLICIES))
    eos = draw(st.sampled_from([vocab - 1, 0, vocab // 2])) if policy not in ("bos", "none") else None
    bos: int | None
    if policy in ("bos", "both"):
        bos = draw(st.sampled_from([vocab - 2, 1]).filter(lambda b: b != eos))
    else:
        bos = eos if policy == "same" else None
    controls = {i for i in (eos, bos) if i is not None}
    inside = bool(controls) and draw(st.integers(0, 3)) == 0  # a parse-mode or chat build, now and then
    ids = st.integers(0, vocab - 1).filter(lambda i: i not in controls)
    if inside:
        ids = st.one_of(ids, st.sampled_from(sorted(controls)))
    least = 1 if not controls else 0  # a document holds at least one token
    body = st.one_of(
        st.lists(ids, min_size=least, max_size=6),
        st.lists(ids, min_size=20, max_size=60),  # longer than most shards of an export
    )
    masked = draw(st.booleans())
    shards: list[list[np.ndarray]] = []
    masks: list[list[np.ndarray]] = []
    for _ in range(draw(st.integers(1, 4))):
        docs, bits = [], []
        for tokens in draw(st.lists(body, max_size=4)):
            doc = ([] if bos is None else [bos]) + tokens + ([] if eos is None else [eos])
            mask = draw(st.lists(st.integers(0, 1), min_size=len(doc), max_size=len(doc)))
            if bos is not None:
                mask[0] = 0
            if eos is not None:
                mask[-1] = 1
            docs.append(np.array(doc, dtype=np.int64))
            bits.append(np.array(mask, dtype=np.uint8))
        shards.append(docs)
        masks.append(bits)
    if not any(shards) and draw(st.integers(0, 4)):  # mostly at least one document; else an empty cache
        doc = ([] if bos is None else [bos]) + [2] + ([] if eos is None else [eos])
        shards[0].append(np.array(doc, dtype=np.int64))
        masks[0].append(np.array([0] * (len(doc) - 1) + [1], dtype=np.uint8))
    return Source(vocab, eos, bos, shards, masks if masked else None, wide=vocab > 1 << 16, inside=inside)


def write_source(root: Path, source: Source) -> Path:
    """The native cache of ``source`` at ``root``: ``write_cache``'s files, with the manifest's EOS, BOS and
    loss mask (its ``.mask`` files and their checksums in the manifest and ledger) as a build writes them."""
    pairs = []
    for docs in source.shards:
        tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        pairs.append((tokens, np.cumsum([len(d) for d in docs], dtype=np.int64)))
    eos_id = 0 if source.eos_id is None else source.eos_id
    write_cache(root, pairs, vocab_size=source.vocab_size, eos_id=eos_id)
    manifest = load_manifest(root)
    table = manifest.table
    if source.masks is not None:
        crcs = []
        for index, masks in enumerate(source.masks):
            data = (np.concatenate(masks) if masks else np.zeros(0)).astype(np.uint8).tobytes()
            mask_path(root, shard_name(index)).write_bytes(data)
            crcs.append(zlib.crc32(data))
            entry_path = root / ledger_key(shard_name(index))
            entry = json.loads(entry_path.read_bytes())
            del entry["checksum"]
            entry["mask_checksum"] = checksum_text(crcs[-1])
            entry_path.write_bytes(encode_json(with_checksum(entry)))
        table = replace(table, mask_crc32=np.array(crcs, dtype=np.uint32))
    manifest = replace(
        manifest,
        eos=EosPolicy(source.eos_id is not None, source.eos_id),
        bos=BosPolicy(source.bos_id is not None, source.bos_id),
        loss_mask=source.masks is not None,
        table=table,
        settings=BuildSettings.from_json({"synthetic": True, "special_tokens": "parse"})
        if source.inside
        else manifest.settings,
    )
    write_manifest(root, manifest)
    return root


# ----------------------------------------------------------------------------- the model of each format


@dataclass(frozen=True)
class Refused:
    """The export (``stage="export"``) or the open of what it wrote (``"open"``) is refused with ``error``,
    whose message holds each of ``words``."""

    error: type[StreampackError]
    words: tuple[str, ...]
    stage: str = "export"


@dataclass(frozen=True)
class Reads:
    """What opening the export gives: each of ``paths`` (relative to the destination: the destination
    itself, or a file in it) opened with ``declared``, their documents ``docs`` end to end (``parts``: how
    many each, where there are several), and ``masks`` (None: no loss mask). ``source`` is the cache that
    opening gives, as a source of a further export; ``warns``: opening says some shards hold no boundary."""

    docs: list[np.ndarray]
    masks: list[np.ndarray] | None
    source: Source
    declared: dict[str, Any] = field(default_factory=dict)
    paths: tuple[str, ...] = ("",)
    parts: tuple[int, ...] | None = None
    warns: bool = False


def reads(source: Source, docs: list[np.ndarray], masks: list[np.ndarray] | None, **how: Any) -> Reads:
    """What is read back: ``docs`` and ``masks``, from a cache of ``source``'s policies unless ``how``
    says others (``eos_id``, ``bos_id``, ``wide``, ``continued``; the rest are :class:`Reads` fields)."""
    policy = {k: how.pop(k) for k in ("eos_id", "bos_id", "wide", "continued", "inside") if k in how}
    read = replace(source, shards=[docs], masks=None if masks is None else [masks], **policy)
    if read.eos_id is None and read.bos_id is None:
        read = replace(read, inside=False, continued=False)
    return Reads(docs, masks, read, **how)


def as_declared(source: Source) -> dict[str, Any]:
    """The policies of files opened with ``source.declared()``: its ids, where it declares them."""
    declared = source.declared()
    return {"eos_id": declared.get("eos_id"), "bos_id": declared.get("bos_id"), "continued": False}


def mask_refusal(source: Source, options: dict[str, Any]) -> Refused | None:
    """The refusal of a masked cache by a format without a loss mask, unless told to drop it."""
    if source.masks is not None and not options.get("drop_loss_mask"):
        return Refused(OptionsError, ("loss mask", "drop_loss_mask"))
    return None


def split_after(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    """``tokens`` cut after each ``eos`` (a tail without one is a last document)."""
    cuts = (np.flatnonzero(tokens == eos) + 1).tolist()
    bounds = [0, *cuts] + ([len(tokens)] if not cuts or cuts[-1] != len(tokens) else [])
    return [tokens[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def split_before(tokens: np.ndarray, delimiter: int) -> list[np.ndarray]:
    """``tokens`` cut before each ``delimiter`` (what precedes the first one is a first document)."""
    cuts = [c for c in np.flatnonzero(tokens == delimiter).tolist() if c]
    bounds = [0, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def stream_of(docs: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.zeros(0, dtype=np.int64), *docs]).astype(np.int64)


def model_megatron(source: Source, options: dict[str, Any]) -> Refused | Reads:
    refused = mask_refusal(source, options)
    if refused:
        return refused
    dtype = options.get("dtype", "optimal")
    if dtype == "uint16" and source.vocab_size > 1 << 16:
        return Refused(OptionsError, ("does not fit", "uint16"))
    wide = {"optimal": source.vocab_size >= 65500, "cache": source.wide, "uint16": False, "int32": True}[
        dtype
    ]
    if wide and source.vocab_size > 1 << 31:
        return Refused(OptionsError, ("does not fit", "int32", "vocab_size"))
    return reads(source, source.docs, None, declared=source.declared(), wide=wide, **as_declared(source))


def model_llmc(source: Source, options: dict[str, Any]) -> Refused | Reads:
    refused = mask_refusal(source, options)
    if refused:
        return refused
    eos, bos = source.eos_id, source.bos_id
    if eos is None and bos is None:
        return Refused(OptionsError, ("no EOS or BOS", "boundaries"))
    if not len(source.stream):
        return Refused(OptionsError, ("holds no tokens", "empty dataset"))
    if bos is not None:
        delimiter = bos
        written = [doc[:-1] if eos is not None else doc for doc in source.docs]
    else:
        assert eos is not None
        delimiter = eos
        written = [np.concatenate([[eos], doc[:-1]]) for doc in source.docs]
    stream = stream_of(written)
    size = options.get("shard_tokens", 10**8)
    shards = [split_before(stream[start : start + size], delimiter) for start in range(0, len(stream), size)]
    docs = [doc for shard in shards for doc in shard]
    # A shard in which the delimiter never occurs (the middle of a long document) is said to be one.
    undelimited = any(len(shard) == 1 and shard[0][0] != delimiter for shard in shards)
    continued = any(doc[0] != delimiter for doc in docs)
    return reads(source, docs, None, eos_id=None, bos_id=delimiter, continued=continued, inside=False,
                 warns=undelimited)  # fmt: skip


def model_nanogpt(source: Source, options: dict[str, Any]) -> Refused | Reads:
    refused = mask_refusal(source, options)
    if refused:
        return refused
    eos = source.eos_id
    if eos is None:
        return Refused(OptionsError, ("no EOS", "boundaries"))
    if source.bos_id == eos:
        return Refused(OptionsError, ("BOS is its EOS", "boundaries"))
    if options.get("dtype", "uint16") == "uint16" and source.vocab_size > 1 << 16:
        return Refused(OptionsError, ("does not fit", "uint16"))
    wide = options.get("dtype") == "cache" and source.wide
    declared: dict[str, Any] = {"eos_id": eos, **({"dtype": "uint32"} if wide else {})}
    val = options.get("val")
    if val is None:
        docs = split_after(source.stream, eos)
        return reads(source, docs, None, declared=declared, bos_id=None, wide=wide, continued=False,
                     inside=False)  # fmt: skip
    if isinstance(val, int) and val > len(source.docs):
        return Refused(OptionsError, ("holdout",))
    held = held_out(source, val, options.get("split_seed", 0))
    train = split_after(stream_of([doc for doc, out in zip(source.docs, held) if not out]), eos)
    validation = split_after(stream_of([doc for doc, out in zip(source.docs, held) if out]), eos)
    paths = ("train.bin",) + (("val.bin",) if validation else ())
    return reads(source, train + validation, None, declared=declared, paths=paths,
                 parts=(len(train), len(validation)), bos_id=None, wide=wide, continued=False,
                 inside=False)  # fmt: skip


def held_out(source: Source, val: float | int, seed: int) -> list[bool]:
    """Which documents nanoGPT's ``val`` holds out: those :meth:`Cache.split` chooses (which documents a
    split chooses is the split's rule, not the export's, so the model asks it)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        streampack.open(write_source(Path(tmp) / "c", source)) as cache,
    ):
        chosen = cache.split(val, seed=seed)[1].chosen
        return [bool(b) for s in range(cache.num_shards) for b in chosen.in_shard(s)]


def model_datatrove(source: Source, options: dict[str, Any]) -> Refused | Reads:
    return reads(source, source.docs, source.doc_masks, declared=source.declared(), **as_declared(source))


def model_olmo(source: Source, options: dict[str, Any]) -> Refused | Reads:
    if source.eos_id is None:
        return Refused(OptionsError, ("no EOS", "boundaries"))
    if source.bos_id == source.eos_id:
        return Refused(OptionsError, ("BOS is its EOS", "boundaries"))
    # Documents that hold the EOS inside (a parse-mode or chat build) would be cut there, as OLMo-core cuts
    # them: refused, naming the first (test_olmo_export_of_documents_that_hold_their_eos).
    if source.inside and any(source.eos_id in list(doc[:-1]) for doc in source.docs):
        return Refused(OptionsError, ("holds the EOS id",))
    if not source.docs:  # no token file, no label mask file: nothing says there is a mask
        return reads(source, [], None)
    return reads(source, source.docs, source.doc_masks)


def model_mds(source: Source, options: dict[str, Any]) -> Refused | Reads:
    refused = mask_refusal(source, options)
    if refused:
        return refused
    seq_len = options.get("seq_len")
    if seq_len is None:
        return reads(source, source.docs, None, declared=source.declared(), **as_declared(source))
    stream = source.stream
    windows = [stream[i * seq_len : (i + 1) * seq_len] for i in range(len(stream) // seq_len)]
    return reads(source, windows, None, eos_id=None, bos_id=None, continued=False)


def model_streampack(source: Source, options: dict[str, Any]) -> Refused | Reads:
    return reads(source, source.docs, source.doc_masks)


MODELS: dict[str, Callable[[Source, dict[str, Any]], Refused | Reads]] = {
    "megatron": model_megatron,
    "llmc": model_llmc,
    "nanogpt": model_nanogpt,
    "datatrove": model_datatrove,
    "olmo": model_olmo,
    "mds": model_mds,
    "streampack": model_streampack,
}


# ----------------------------------------------------------------------------- the property


def docs_of(cache: streampack.Cache) -> list[np.ndarray]:
    return [np.asarray(cache.doc(i)) for i in range(cache.num_docs)]


def masks_of(cache: streampack.Cache) -> list[np.ndarray] | None:
    if not cache.has_loss_mask:
        return None
    return [np.asarray(cache.doc_loss_mask(i)) for i in range(cache.num_docs)]


def assert_docs(got: Sequence[np.ndarray], expected: Sequence[np.ndarray], what: str) -> None:
    """The same documents, token for token (as integers: a uint16 cache read back as uint32 is the same)."""
    got_lists = [np.asarray(d, dtype=np.int64).tolist() for d in got]
    expected_lists = [np.asarray(d, dtype=np.int64).tolist() for d in expected]
    assert got_lists == expected_lists, what


def assert_masks(got: Sequence[np.ndarray] | None, expected: Sequence[np.ndarray] | None, what: str) -> None:
    if expected is None:
        assert got is None, f"{what}: a loss mask where none was expected"
        return
    assert got is not None, f"{what}: no loss mask"
    assert_docs([(np.asarray(m) != 0).astype(np.int64) for m in got], expected, f"{what} (loss mask)")


def exported(
    cache: streampack.Cache, fmt: str, dest: Path, options: dict[str, Any], model: Refused | Reads
) -> bool:
    """Export ``cache``; whether it was written (a refusal the model says, leaving nothing behind)."""
    if isinstance(model, Refused) and model.stage == "export":
        with pytest.raises(StreampackError) as raised:
            cache.export(fmt, dest, **options)
        assert_refusal(raised.value, model)
        assert not list(dest.parent.glob(f"{dest.name}*")), "a refused export left files"
        return False
    cache.export(fmt, dest, **options)
    return True


def assert_refusal(error: BaseException, model: Refused) -> None:
    assert isinstance(error, model.error), repr(error)
    assert all(word in str(error) for word in model.words), str(error)


def opened(
    dest: Path, model: Reads, vocab: dict[str, Any]
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The documents and masks of every path ``model`` names, each opened with its declaration (and
    ``vocab``), verified and warned about as the model says."""
    docs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    masked: list[bool] = []
    for index, name in enumerate(model.paths):
        path = dest / name if name else dest
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            cache = streampack.open(path, **model.declared, **vocab)
            report = streampack.verify(path, **model.declared, **vocab)
        boundaries = [w for w in warned if issubclass(w.category, DocumentBoundaryWarning)]
        assert bool(boundaries) == model.warns, f"{path}: warnings {[str(w.message) for w in warned]}"
        assert report.ok, f"verify {path}: {report.problems}"
        with cache:
            part = docs_of(cache)
            if model.parts is not None:
                assert len(part) == model.parts[index], f"{path}: {len(part)} documents"
            docs += part
            masked.append(cache.has_loss_mask)
            masks += masks_of(cache) or []
    assert len(set(masked)) == 1, f"{dest}: a loss mask in some files only"
    return docs, masks if masked[0] else None


def check_reads(fmt: str, dest: Path, model: Refused | Reads, root: Path, shard_tokens: int,
                vocab: dict[str, Any]) -> None:  # fmt: skip
    """The export at ``dest`` opens as ``model`` says (or is refused so), and converts to a native cache
    that verify passes and that holds the same documents and masks."""
    if isinstance(model, Refused):
        with pytest.raises(StreampackError) as raised:
            streampack.open(dest, **vocab)
        assert_refusal(raised.value, model)
        return
    docs, masks = opened(dest, model, vocab)
    assert_docs(docs, model.docs, f"{fmt}: documents opened")
    assert_masks(masks, model.masks, f"{fmt}: opened")
    for name, part in zip(model.paths, parts(model)):
        native = root / f"native-{name or 'all'}"
        with warnings.catch_warnings():
            if model.warns:  # said by the open above
                warnings.simplefilter("ignore", DocumentBoundaryWarning)
            convert(
                dest / name if name else dest, native, shard_tokens=shard_tokens, **model.declared, **vocab
            )
        report = streampack.verify(native)
        assert report.ok, f"verify of the converted {fmt}: {report.problems}"
        with streampack.open(native) as converted:
            assert_docs(docs_of(converted), model.docs[part], f"{fmt}: documents converted")
            assert_masks(
                masks_of(converted), None if model.masks is None else model.masks[part], f"{fmt}: converted"
            )


def parts(model: Reads) -> list[slice]:
    """The documents of each path of ``model``, as slices of ``model.docs``."""
    if model.parts is None:
        return [slice(None)]
    bounds = np.cumsum([0, *model.parts]).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)][: len(model.paths)]


def check_round_trip(fmt: str, source: Source, options: dict[str, Any], shard_tokens: int) -> None:
    """Export ``source`` as ``fmt`` with ``options``: refused as the model says, or opened with the model's
    documents and masks; then converted to a native cache that verify passes, with the same documents."""
    model = MODELS[fmt](source, options)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with streampack.open(write_source(root / "source", source)) as cache:
            if not exported(cache, fmt, root / "out", options, model):
                return
        check_reads(fmt, root / "out", model, root, shard_tokens, {})


# ----------------------------------------------------------------------------- options drawn per format


def mask_options(source: Source) -> st.SearchStrategy[dict[str, Any]]:
    """``drop_loss_mask`` (given or not) for a masked cache; nothing for one without a mask."""
    if source.masks is None:
        return st.just({})
    return st.sampled_from([{}, {"drop_loss_mask": True}])


def optional(**strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=strategies)


OPTIONS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "megatron": optional(dtype=st.sampled_from(["optimal", "cache", "uint16", "int32"])),
    "llmc": optional(shard_tokens=st.integers(1, 40)),
    "nanogpt": optional(
        val=st.one_of(st.floats(0.05, 0.95), st.integers(1, 4)),
        dtype=st.sampled_from(["uint16", "cache"]),
        split_seed=st.integers(0, 3),
    ),
    "datatrove": st.just({}),
    "olmo": st.just({}),
    "mds": optional(seq_len=st.integers(1, 12), size_limit=st.integers(64, 400)),
    "streampack": optional(shard_tokens=st.integers(1, 50)),
}
MASKLESS = ("megatron", "llmc", "nanogpt", "mds")  # the formats that take drop_loss_mask


def options_for(fmt: str, source: Source) -> st.SearchStrategy[dict[str, Any]]:
    if fmt not in MASKLESS:
        return OPTIONS[fmt]
    return st.tuples(OPTIONS[fmt], mask_options(source)).map(lambda pair: {**pair[0], **pair[1]})


SHARD_TOKENS = st.integers(1, 50)  # of the native cache a convert makes

#: The sizes of the buffers and shards that readers and writers cut their work into, where a case makes
#: them small enough for the cuts to fall inside its few tokens (module constants, read when used).
BUFFERS = {
    (writing, "CHUNK_TOKENS"): st.integers(1, 7),  # tokens read (and cast) at once
    (hf, "BATCH_TOKENS"): st.integers(1, 9),  # tokens a record batch holds
    (nanogpt, "SHARD_TOKENS"): st.integers(1, 20),  # tokens of a shard of a nanoGPT file read back
    (scanning, "KEPT_ENDS_BYTES"): st.integers(0, 64),  # document ends an open keeps for the first reads
    (native, "_CRC_BYTES"): st.integers(1, 16),  # bytes a convert's CRC reads at once
}
SMALL = st.none() | st.fixed_dictionaries({}, optional={key: size for key, size in BUFFERS.items()})


@contextlib.contextmanager
def buffers(sizes: dict[tuple[Any, str], int] | None) -> Iterator[None]:
    """The module constants ``sizes`` names set to its values, for the duration."""
    with pytest.MonkeyPatch.context() as patch:
        for (module, name), size in (sizes or {}).items():
            patch.setattr(module, name, size)
        yield


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(MODELS))
@PROPERTY
@given(data=st.data(), source=sources(), shard_tokens=SHARD_TOKENS, small=SMALL)
def test_export_opens_with_the_models_documents_and_converts(
    fmt: str, data: st.DataObject, source: Source, shard_tokens: int, small: dict[Any, int] | None
) -> None:
    options = data.draw(options_for(fmt, source), label="options")
    with buffers(small):
        check_round_trip(fmt, source, options, shard_tokens)


# ----------------------------------------------------------------------------- an export of an export


def check_chain(first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]], source: Source,
                declare_vocab: bool, shard_tokens: int) -> None:  # fmt: skip
    """Export ``source`` as the ``first`` format, open that, export it as the ``second``: what opening the
    second gives is the second's model of what the first's model reads (where ``declare_vocab``, the files
    are opened with the source's vocabulary; else it is their dtype's)."""
    fmt, options = first
    model = MODELS[fmt](source, options)
    if not isinstance(model, Reads) or len(model.paths) > 1:
        return  # check_round_trip's cases
    middle = model.source
    vocab = {"vocab_size": source.vocab_size} if declare_vocab else {}
    if not declare_vocab and fmt not in ("nanogpt", "olmo", "streampack"):  # which record it
        middle = replace(middle, vocab_size=1 << 32 if middle.wide else 1 << 16)  # their dtype's
    later, later_options = second
    final = MODELS[later](middle, later_options)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with streampack.open(write_source(root / "source", source)) as cache:
            cache.export(fmt, root / "first", **options)
        declared = {**model.declared, **(vocab if fmt != "streampack" else {})}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DocumentBoundaryWarning)  # llm.c's: see check_round_trip
            with streampack.open(root / "first", **declared) as cache:
                if not exported(cache, later, root / "second", later_options, final):
                    return
        check_reads(later, root / "second", final, root, shard_tokens, {})


@st.composite
def chains(draw: st.DrawFn) -> tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]], Source]:
    source = draw(sources())
    fmt = draw(st.sampled_from(list(MODELS)))
    options = draw(options_for(fmt, source).map(lambda o: {k: v for k, v in o.items() if k != "val"}))
    later = draw(st.sampled_from(list(MODELS)))
    model = MODELS[fmt](source, options)
    middle = model.source if isinstance(model, Reads) else source
    later_options = draw(options_for(later, middle))
    return (fmt, options), (later, later_options), source


@pytest.mark.slow
@CHAINS
@given(chain=chains(), declare_vocab=st.booleans(), shard_tokens=SHARD_TOKENS, small=SMALL)
def test_an_export_of_an_export_opens_with_the_models_documents(
    chain: tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]], Source],
    declare_vocab: bool,
    shard_tokens: int,
    small: dict[Any, int] | None,
) -> None:
    first, second, source = chain
    with buffers(small):
        check_chain(first, second, source, declare_vocab, shard_tokens)


# ----------------------------------------------------------------------------- hf: rows read with pyarrow


def hf_tables(dest: Path, files: str) -> list[pa.Table]:
    """The rows of an hf export, once per kind of file it wrote (Parquet, Arrow), in file order."""
    tables = []
    if files in ("parquet", "both"):
        tables.append(pq.read_table(sorted((dest / "data").glob("train-*.parquet"))))
    if files in ("arrow", "both"):
        state = json.loads((dest / "state.json").read_text())
        streams = [pa.ipc.open_stream(dest / f["filename"]).read_all() for f in state["_data_files"]]
        tables.append(pa.concat_tables(streams))
    return tables


def hf_labels(tokens: np.ndarray, mask: np.ndarray | None) -> list[int]:
    """A document row's labels: its ids, -100 at its first token and where its mask is 0."""
    labels = np.asarray(tokens, dtype=np.int64).copy()
    if mask is not None:
        labels[mask == 0] = -100
    labels[:1] = -100
    return labels.tolist()


def window_positions(source: Source, seq_len: int, count: int) -> list[list[int]]:
    """Each window's position ids: a token's place in its document, counted from the window's start."""
    if not count:
        return []
    starts = np.cumsum([0] + [len(d) for d in source.docs])[:-1]
    at = np.arange(count * seq_len)
    doc_start = starts[np.searchsorted(starts, at, side="right") - 1]
    return (at - np.maximum(doc_start, at - at % seq_len)).reshape(count, seq_len).tolist()


def check_hf(source: Source, options: dict[str, Any]) -> None:
    """The hf export's rows, read with pyarrow: the documents (and labels), the windows of ``seq_len``, or
    the samples of ``Cache.packed``; ``streampack.open`` reads none of it (no reader), and says so."""
    seq_len = options.get("seq_len")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with streampack.open(write_source(root / "source", source)) as cache:
            cache.export("hf", root / "out", **options)
            samples = cache.packed(seq_len) if seq_len is not None and options.get("packed") else None
            packed = None if samples is None else [np.asarray(samples[i]) for i in range(len(samples))]
        with pytest.raises(CacheError, match="not a streampack cache"):
            streampack.open(root / "out")
        masks = None if source.doc_masks is None else stream_of(source.doc_masks)
        for table in hf_tables(root / "out", options.get("files", "parquet")):
            rows = table.to_pydict()
            ids = [np.array(r) for r in rows.get("input_ids", [])]
            if seq_len is None:
                assert_docs(ids, source.docs, "hf documents")
                if source.doc_masks is None:
                    assert "labels" not in rows
                else:
                    assert rows["labels"] == [hf_labels(d, m) for d, m in zip(source.docs, source.doc_masks)]
                continue
            if packed is not None:
                assert_docs(ids, packed, "hf packed samples")
            else:
                stream = source.stream
                windows = [stream[i * seq_len : (i + 1) * seq_len] for i in range(len(stream) // seq_len)]
                assert_docs(ids, windows, "hf windows")
                positions = window_positions(source, seq_len, len(windows))
                assert rows["position_ids"] == positions
                targets = np.array(positions, dtype=np.int64).reshape(-1) != 0
                if masks is not None:
                    targets &= masks[: len(targets)] != 0
                expected = np.where(targets, stream[: len(targets)], -100).reshape(-1, seq_len)
                assert rows["labels"] == expected.tolist()
                continue
            for r, (row, labels) in enumerate(zip(ids, map(np.array, rows["labels"]))):
                kept = labels != -100
                assert (labels[kept] == row[kept]).all(), f"row {r}: labels {labels} of {row}"
                assert not kept[np.array(rows["position_ids"][r]) == 0].any(), (
                    f"row {r}: a first token's label"
                )


HF_OPTIONS = st.fixed_dictionaries(
    {"files": st.sampled_from(["parquet", "arrow", "both"])},
    optional={"seq_len": st.integers(1, 12), "packed": st.just(True), "file_tokens": st.integers(1, 30)},
).filter(lambda o: "seq_len" in o or "packed" not in o)


@pytest.mark.slow
@PROPERTY
@given(source=sources(), options=HF_OPTIONS, small=SMALL)
def test_hf_rows_are_the_documents_or_samples(
    source: Source, options: dict[str, Any], small: dict[Any, int] | None
) -> None:
    with buffers(small):
        check_hf(source, options)


# ----------------------------------------------------------------------------- a real build, the CLI, and the
# ----------------------------------------------------------------------------- other ecosystems' readers

CL100K_EOS, CL100K_BOS = 100257, 100258  # <|endoftext|>, and <|fim_prefix|> as a BOS


@pytest.fixture(scope="module")
def cl100k_sft(tmp_path_factory: pytest.TempPathFactory, tiktoken_gpt2: Path) -> streampack.Cache:
    """A real uint32 SFT cache: cl100k's tiktoken ranks, prompt/response fields (a loss mask), a BOS and
    the EOS."""
    ranks = tiktoken_gpt2.with_name("cl100k_base.tiktoken")
    if not ranks.exists():
        pytest.skip(f"{ranks} is absent (../shared/data)")
    tmp = tmp_path_factory.mktemp("cl100k")
    for part in range(3):
        records = [
            {"prompt": f"Question {i}: what is {i} times {part + 2}?", "response": f"It is {i * (part + 2)}."}
            for i in range(20 * part, 20 * part + 20)
        ]
        (tmp / f"part{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    streampack.build(
        sorted(tmp.glob("part*.jsonl")), tmp / "cache", tokenizer=f"tiktoken:{ranks}",
        fields=["prompt", "response"], bos_id=CL100K_BOS, progress=False,
    )  # fmt: skip
    cache = streampack.open(tmp / "cache")
    assert (cache.dtype, cache.eos_id, cache.bos_id, cache.has_loss_mask) == (
        np.uint32, CL100K_EOS, CL100K_BOS, True
    )  # fmt: skip
    return cache


@pytest.mark.slow
def test_cli_export_convert_verify_of_a_real_uint32_sft_cache(
    cl100k_sft: streampack.Cache, tmp_path: Path
) -> None:
    """The commands a user runs: export (datatrove keeps the mask; llm.c drops it when told), convert with
    what the files do not record, verify; the converted caches hold the model's documents."""
    cache = cl100k_sft
    source = Source(cache.vocab_size, cache.eos_id, cache.bos_id, [docs_of(cache)], [masks_of(cache) or []],
                    wide=True)  # fmt: skip
    dt, native = tmp_path / "dt", tmp_path / "dt-native"
    run_cli("export", cache.root, "--to", "datatrove", "--out", dt, "--no-progress")
    ids = ["--eos-id", str(CL100K_EOS), "--bos-id", str(CL100K_BOS)]
    run_cli("verify", dt, *ids)
    run_cli("convert", dt, "--out", native, "--shard-tokens", "300", "--no-progress", *ids)
    run_cli("verify", native)
    with streampack.open(native) as converted:
        assert converted.num_shards > 3
        assert_docs(docs_of(converted), source.docs, "datatrove, converted")
        assert_masks(masks_of(converted), source.doc_masks, "datatrove, converted")
    refused = run_cli("export", cache.root, "--to", "llmc", "--out", tmp_path / "l", check=False)
    assert refused.returncode != 0 and "--drop-loss-mask" in refused.stderr
    run_cli("export", cache.root, "--to", "llmc", "--out", tmp_path / "l", "--shard-tokens", "300",
            "--drop-loss-mask", "--no-progress")  # fmt: skip
    run_cli("convert", tmp_path / "l", "--out", tmp_path / "l-native", "--no-progress")
    run_cli("verify", tmp_path / "l-native")
    model = model_llmc(source, {"shard_tokens": 300, "drop_loss_mask": True})
    assert isinstance(model, Reads)
    with streampack.open(tmp_path / "l-native") as converted:
        assert converted.bos_id == CL100K_BOS
        assert_docs(docs_of(converted), model.docs, "llmc, converted")


def test_megatron_indexed_dataset_reads_a_uint32_bos_cache_whose_mask_was_dropped(
    cl100k_sft: streampack.Cache, tmp_path: Path
) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    cl100k_sft.export("megatron", tmp_path / "m", drop_loss_mask=True)
    dataset = indexed.IndexedDataset(str(tmp_path / "m"))
    assert dataset.index.dtype == np.int32 and len(dataset) == cl100k_sft.num_docs
    assert_docs([dataset[i] for i in range(len(dataset))], docs_of(cl100k_sft), "IndexedDataset")
    assert all(dataset[i][0] == CL100K_BOS and dataset[i][-1] == CL100K_EOS for i in range(len(dataset)))


def test_datatrove_folder_dataset_reads_uint32_files(cl100k_sft: streampack.Cache, tmp_path: Path) -> None:
    """token_size=4 (what .ds.metadata records): each window of seq_len + 1 tokens is the stream's, and its
    positions restart at each document's end, as datatrove reads the .ds.index."""
    dataset_module = pytest.importorskip("datatrove.utils.dataset")
    cl100k_sft.export("streampack", tmp_path / "sharded", shard_tokens=400)
    source = streampack.open(tmp_path / "sharded")
    source.export("datatrove", tmp_path / "dt")
    assert (tmp_path / "dt" / "00000.ds.metadata").read_text().splitlines()[0].endswith("|4")
    seq_len = 31
    dataset = dataset_module.DatatroveFolderDataset(
        str(tmp_path / "dt"), seq_len, filename_pattern="*.ds", token_size=4, return_positions=True
    )
    item = 0
    for shard in range(source.num_shards):
        tokens = np.asarray(source.shard_tokens(shard), dtype=np.int64)
        ends = np.asarray(source.shard_offsets(shard), dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        for lo in range(0, len(tokens) - seq_len, seq_len + 1):
            sample = dataset[item]
            window = np.arange(lo, lo + seq_len + 1)
            np.testing.assert_array_equal(sample["input_ids"].numpy(), tokens[window])
            doc_start = starts[np.searchsorted(ends, window, side="right")]
            np.testing.assert_array_equal(sample["positions"].numpy(), window - np.maximum(doc_start, lo))
            item += 1
    assert item == len(dataset) > 0


def test_mds_streaming_dataset_reads_uint32_documents(
    cl100k_sft: streampack.Cache, tmp_path: Path, streaming: Any
) -> None:
    cl100k_sft.export("mds", tmp_path / "mds", size_limit=1 << 10, drop_loss_mask=True)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    assert len(index["shards"]) > 1 and index["shards"][0]["column_encodings"] == ["ndarray:uint32"]
    dataset = streaming.StreamingDataset(local=str(tmp_path / "mds"), shuffle=False, batch_size=1)
    assert len(dataset) == cl100k_sft.num_docs
    assert_docs(
        [dataset[i]["input_ids"] for i in range(len(dataset))], docs_of(cl100k_sft), "StreamingDataset"
    )


def test_hf_load_from_disk_reads_uint32_documents_and_labels(
    cl100k_sft: streampack.Cache, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    cl100k_sft.export("hf", tmp_path / "hf", files="arrow")
    dataset = datasets.load_from_disk(str(tmp_path / "hf")).with_format("numpy")
    docs, masks = docs_of(cl100k_sft), masks_of(cl100k_sft)
    assert masks is not None and len(dataset) == len(docs)
    assert_docs(list(dataset["input_ids"]), docs, "load_from_disk input_ids")
    assert [list(row) for row in dataset["labels"]] == [hf_labels(d, m) for d, m in zip(docs, masks)]


# ----------------------------------------------------------------------------- what the model found open


def test_olmo_export_of_documents_that_hold_their_eos(tmp_path: Path) -> None:
    """A chat template's EOS inside a document (``<|im_end|>`` after each turn, where it is the EOS): the
    export refuses the cache, naming the document and where (OLMo-core would cut it there)."""
    eos, bos = 299, 298
    docs = [np.array([bos, 5, eos, 6, eos]), np.array([bos, 7, eos])]
    masks = [np.array([0, 0, 1, 1, 1], dtype=np.uint8), np.array([0, 1, 1], dtype=np.uint8)]
    source = Source(300, eos, bos, [docs], [masks], inside=True)
    with streampack.open(write_source(tmp_path / "c", source)) as cache:
        assert streampack.verify(cache.root).ok
        with pytest.raises(OptionsError, match="document 0 holds the EOS id 299 at its token 2"):
            cache.export("olmo", tmp_path / "olmo")
    assert not (tmp_path / "olmo").exists()


# ----------------------------------------------------------------------------- the exhaustive sweep


def grid_source(policy: str, vocab: int, masked: bool) -> Source:
    """A fixed cache of each policy: a 1-token body, a document longer than most shards, an empty shard,
    ids at both ends of the vocabulary (the top ones past uint16 in a uint32 cache)."""
    eos = vocab - 1 if policy in ("eos", "both", "same") else None
    bos = {"bos": vocab - 2, "both": vocab - 2, "same": eos}.get(policy)
    bodies = [[[5], [vocab - 3, 0, 7]], [], [list(range(1, 41)), [vocab - 4]], [[9, 9]]]
    rng = np.random.default_rng(len(policy) + vocab)
    shards, masks = [], []
    for shard in bodies:
        docs = [np.array(([] if bos is None else [bos]) + b + ([] if eos is None else [eos])) for b in shard]
        bits = [rng.integers(0, 2, len(d)).astype(np.uint8) for d in docs]
        for bit in bits:
            if bos is not None:
                bit[0] = 0
            if eos is not None:
                bit[-1] = 1
        shards.append(docs)
        masks.append(bits)
    return Source(vocab, eos, bos, shards, masks if masked else None, wide=vocab > 1 << 16)


GRID_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "megatron": [{}, {"dtype": "cache"}, {"dtype": "uint16"}, {"dtype": "int32"}],
    "llmc": [{}, {"shard_tokens": 1}, {"shard_tokens": 3}, {"shard_tokens": 41}],
    "nanogpt": [{}, {"dtype": "cache"}, {"val": 0.5}, {"val": 2, "split_seed": 1}, {"val": 9}],
    "datatrove": [{}],
    "olmo": [{}],
    "mds": [{}, {"seq_len": 1}, {"seq_len": 5}, {"size_limit": 64}],
    "streampack": [{}, {"shard_tokens": 1}, {"shard_tokens": 5}],
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(MODELS))
def test_every_policy_dtype_mask_and_option_exports_as_the_model_says(fmt: str) -> None:
    """Every format x uint16/uint32 x EOS/BOS/both/one id/none x mask or not x its options (with the mask
    dropped, and not, where the format has none), each converted in shards of 3 tokens."""
    for policy in POLICIES:
        for vocab in (50257, 65500, 100277):
            for masked in (False, True):
                source = grid_source(policy, vocab, masked)
                drops = [{}, {"drop_loss_mask": True}] if masked and fmt in MASKLESS else [{}]
                for options in GRID_OPTIONS[fmt]:
                    for drop in drops:
                        check_round_trip(fmt, source, {**options, **drop}, 3)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_every_policy_and_mask_exports_to_hf_as_the_model_says(packed: bool) -> None:
    for policy in POLICIES:
        for vocab in (50257, 100277):
            for masked in (False, True):
                source = grid_source(policy, vocab, masked)
                for options in ({"files": "both"}, {"files": "arrow", "seq_len": 4}, {"seq_len": 7}):
                    if packed and "seq_len" not in options:
                        continue
                    check_hf(source, {**options, **({"packed": True} if packed else {})})
