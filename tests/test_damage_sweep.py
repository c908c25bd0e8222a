"""The damage sweep: every kind of file of a cache, damaged every way, locally and in object storage.

Every damage is found by ``verify``, and no reader serves it silently: a reader refuses it with a
``CacheError`` naming the file, or (a plan, derived from the shards, in a writable cache) plans it again
and serves the right samples. The one exception is by design and documented: a local reader serves token
and loss-mask bytes as mapped, their sizes checked; checking every token's checksum in every process would
read the whole cache each time, so their content is ``verify``'s to check (object storage: each copy is
checked when it is fetched, so there nothing damaged is served at all).

A split's selection is not stored (a hash of each document's index decides its side), so there is no
file of it to damage; a split's plans are plans like the others and are swept with them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError
from tests.conftest import s3_options, write_jsonl

SEQ_LEN = 64


def flip(at: float) -> Callable[[bytes], bytes | None]:
    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        out[min(int(len(out) * at), len(out) - 1)] ^= 0x01
        return bytes(out)

    return damage


DAMAGES: dict[str, Callable[[bytes], bytes | None]] = {
    "first byte flipped": flip(0.0),
    "middle byte flipped": flip(0.5),
    "last byte flipped": flip(1.0),
    # Two bytes: a JSON file's final newline is not part of its content (its checksum covers the content).
    "cut by two bytes": lambda data: data[:-2],
    "cut in half": lambda data: data[: len(data) // 2],
    "one byte appended": lambda data: data + b"\0",
    "deleted": lambda data: None,
}
# Damage to these is found by verify; a local reader serves the bytes as they are (see the docstring).
CONTENT_ONLY_BY_VERIFY = {"first byte flipped", "middle byte flipped", "last byte flipped"}


def build_pristine(root: Path, out: Path | str, **build: Any) -> None:
    """An SFT cache (tokens, offsets, loss masks) of three shards."""
    rows = [{"p": f"prompt {i} " * (1 + i % 5), "r": f"response {i} " * (i % 23)} for i in range(900)]
    streampack.build(
        write_jsonl(root / "in.jsonl", rows), out, fields=["p", "r"], unit_bytes=1 << 16, **build
    )


def read_everything(cache: streampack.Cache) -> dict[str, np.ndarray]:
    """What readers serve: every document and its loss mask, packed samples, one document per sample, the
    packed samples of a split's side."""
    _, validation = cache.split(0.1)
    served = {
        "docs": np.concatenate([cache.doc(i) for i in range(cache.num_docs)]),
        "masks": np.concatenate([cache.doc_loss_mask(i) for i in range(cache.num_docs)]),
    }
    for name, samples in (
        ("packed", cache.packed(SEQ_LEN)),
        ("documents", cache.documents(SEQ_LEN)),
        ("validation", validation.packed(SEQ_LEN)),
    ):
        served[name] = np.asarray(samples[np.arange(len(samples))]).copy()
    return served


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("sweep")
    cache = root / "cache"
    build_pristine(root, cache, workers=1)
    truth = read_everything(streampack.open(cache))  # also stores the three plans
    assert streampack.open(cache).num_shards == 3 and len(list((cache / "layouts").iterdir())) == 3
    return cache, truth


def files_of(cache: Path) -> list[str]:
    """Every file of the cache a reader or verify reads (the build lock holds only its holder's pid)."""
    return sorted(
        str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and p.name != "build.lock"
    )


def test_the_sweep_covers_every_kind_of_file(local: tuple[Path, dict[str, np.ndarray]]) -> None:
    kinds = {Path(f).suffix or Path(f).name for f in files_of(local[0])}
    assert kinds == {".json", ".tokens", ".offsets", ".mask", ".bin"}, kinds
    assert {"manifest.json"} < set(files_of(local[0]))


def local_cases() -> list[tuple[str, str]]:
    """(file, damage) for every file of the sweep's cache: built once here to name the cases."""
    return [(f, d) for f in LOCAL_FILES for d in DAMAGES]


# The files of the cache the fixture builds (named here so that each case is its own test).
LOCAL_FILES = [
    "manifest.json",
    *(f"ledger/00000{i}.json" for i in range(3)),
    *(f"shards/00000{i}.{kind}" for i in range(3) for kind in ("tokens", "offsets", "mask")),
    *(
        f"layouts/{{{layout}}}/{name}"
        for layout in ("packed", "documents", "validation")
        for name in ("plan.json", "starts.bin", "shards.bin", "lo.bin", "lengths.bin")
    ),
]


def resolve(cache: Path, name: str) -> Path:
    """A file of the sweep's list: plan folders are named by their layout (``{packed}``)."""
    if "{" not in name:
        return cache / name
    layout = name.split("{")[1].split("}")[0]
    plans = sorted((cache / "layouts").iterdir())
    settings = {p: json.loads((p / "plan.json").read_text())["settings"] for p in plans}
    chosen = {
        "packed": [p for p in plans if p.name.startswith("packed-") and "split" not in settings[p]],
        "documents": [p for p in plans if p.name.startswith("documents-")],
        "validation": [p for p in plans if settings[p].get("split") == "validation"],
    }[layout]
    assert len(chosen) == 1, chosen
    return chosen[0] / name.rsplit("/", 1)[1]


@pytest.mark.parametrize(("name", "damage"), local_cases())
def test_local_damage_is_found_and_never_served(
    local: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, name: str, damage: str
) -> None:
    pristine, truth = local
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    path = resolve(cache, name)
    damaged = DAMAGES[damage](path.read_bytes())
    if damaged is None:
        path.unlink()
    else:
        path.write_bytes(damaged)
    report = streampack.verify(cache)
    assert not report.ok, f"verify missed {damage} of {name}"
    assert any(str(path) in p or path.name in p for p in report.problems), report.problems
    try:
        served = read_everything(streampack.open(cache))
    except CacheError as e:
        assert path.name in str(e), f"the refusal does not name {path.name}: {e}"
        return
    differs = sorted(k for k in truth if not np.array_equal(served[k], truth[k]))
    if name.startswith("shards/") and not name.endswith(".offsets") and damage in CONTENT_ONLY_BY_VERIFY:
        return  # served as mapped: verify's to find (above)
    assert not differs, f"{damage} of {name} served silently: {differs} differ"
    assert name.startswith(("layouts/", "ledger/")), f"{damage} of {name} neither refused nor harmless"
    if name.startswith("layouts/"):
        assert streampack.verify(cache).ok  # planned again, soundly


def test_a_damaged_ledger_entry_is_refused_by_the_readers_that_read_it(
    local: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """A complete cache's readers read no ledger; an unfinished build's do, and refuse a damaged entry."""
    from streampack.format import with_checksum

    cache = tmp_path / "cache"
    shutil.copytree(local[0], cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest.update(complete=False)
    (cache / "manifest.json").write_text(json.dumps(with_checksum(manifest)))
    entry = cache / "ledger" / "000001.json"
    entry.write_text(entry.read_text().replace('"docs": ', '"docs": 1'))
    with pytest.raises(
        CacheError, match=r"000001\.json: the ledger entry's content does not match its checksum"
    ):
        streampack.open(cache, allow_incomplete=True)


# ------------------------------------------------------------------------------------ object storage

REMOTE_FILES = [f for f in LOCAL_FILES if not f.startswith("layouts/")]
REMOTE_DAMAGES = [
    "middle byte flipped",
    "last byte flipped",
    "cut by two bytes",
    "one byte appended",
    "deleted",
]


@pytest.fixture(scope="module")
def remote(
    tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str, local: tuple[Path, dict[str, np.ndarray]]
) -> tuple[Any, str, dict[str, np.ndarray]]:
    """The sweep's cache built to a bucket (byte-identical to the local one), its filesystem and URL."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir("sweep")
    root = tmp_path_factory.mktemp("remote-sweep")
    url = "s3://sweep/c"
    build_pristine(
        root, url, staging_dir=str(root / "stage"), storage_options=s3_options(s3_endpoint), workers=1
    )
    assert sorted(fs.find("sweep/c")) == sorted(f"sweep/c/{name}" for name in REMOTE_FILES)
    return fs, url, local[1]  # the same documents: the same samples


@pytest.mark.parametrize(("name", "damage"), [(f, d) for f in REMOTE_FILES for d in REMOTE_DAMAGES])
def test_damage_in_object_storage_is_found_and_never_served(
    remote: tuple[Any, str, dict[str, np.ndarray]], s3_endpoint: str, tmp_path: Path, name: str, damage: str
) -> None:
    fs, url, truth = remote
    key = f"{url.removeprefix('s3://')}/{name}"
    original = fs.cat_file(key)
    damaged = DAMAGES[damage](original)
    try:
        if damaged is None:
            fs.rm(key)
        else:
            fs.pipe_file(key, damaged)
        report = streampack.verify(url, storage_options=s3_options(s3_endpoint))
        assert not report.ok, f"verify missed {damage} of {name}"
        assert any(p.startswith(f"{url}/{name}") for p in report.problems), report.problems
        try:
            opened = streampack.open(
                url, local_dir=tmp_path / "copy", storage_options=s3_options(s3_endpoint)
            )
            served = read_everything(opened)
        except CacheError as e:
            assert f"{url}/{name}" in str(e), f"the refusal does not name {url}/{name}: {e}"
            return
        assert name.startswith("ledger/"), f"{damage} of {name} was not refused"
        assert all(np.array_equal(served[k], truth[k]) for k in truth)  # a complete cache reads no ledger
    finally:
        fs.pipe_file(key, original)


def test_a_damaged_plan_beside_a_local_copy_is_planned_again(
    remote: tuple[Any, str, dict[str, np.ndarray]], s3_endpoint: str, tmp_path: Path
) -> None:
    _, url, truth = remote
    copy = tmp_path / "copy"
    first = streampack.open(url, local_dir=copy, storage_options=s3_options(s3_endpoint)).packed(SEQ_LEN)
    assert first.layout.directory is not None and first.layout.directory.parent == copy / "layouts"
    lo = first.layout.directory / "lo.bin"
    values = np.fromfile(lo, dtype="<i8")
    values[3] += 7
    values.tofile(lo)
    again = streampack.open(url, local_dir=copy, storage_options=s3_options(s3_endpoint)).packed(SEQ_LEN)
    assert np.array_equal(again[np.arange(len(again))], truth["packed"])
