"""Shared fixtures: real tokenizers, corpora written as real files, and the CLI run as a subprocess."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import zstandard

import streampack

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GPT2_JSON = SHARED_DATA / "tokenizers" / "gpt2" / "tokenizer.json"
TIKTOKEN_GPT2 = SHARED_DATA / "tokenizers" / "tiktoken" / "gpt2.tiktoken"
SAMPLE_CORPUS = SHARED_DATA / "corpus" / "natural-sample.jsonl.zst"
STUBS = Path(__file__).resolve().parent / "stubs"

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; caches keep the pieces on disk.",
    "Ünïcödé text, emoji 🙂 and CJK 漢字 must survive the round trip.",
    "def main():\n    return 42\n",
] * 50


# ----------------------------------------------------------------------------- the libraries' caches

#: Where the libraries the tests import keep what they cache, by environment variable: the Hugging Face
#: libraries (``datasets.load_dataset`` its Arrow files, the hub its downloads) and matplotlib (its font
#: list: transformers and Lightning import it). Each is a folder of the session's own (None: unset, so that
#: it follows HF_HOME), so that a test run writes nothing into the user's caches. The libraries read these
#: when imported, so the session sets them before collection (:func:`pytest_configure`), not in a
#: fixture, which runs after the test modules have imported them.
CACHES: dict[str, str | None] = {
    "HF_HOME": "huggingface",
    "HF_DATASETS_CACHE": "huggingface/datasets",
    "HF_HUB_CACHE": "huggingface/hub",
    "HUGGINGFACE_HUB_CACHE": "huggingface/hub",
    "HF_MODULES_CACHE": "huggingface/modules",
    "HF_ASSETS_CACHE": "huggingface/assets",
    "HF_XET_CACHE": "huggingface/xet",
    "TRANSFORMERS_CACHE": None,  # older transformers' own (deprecated: setting it warns)
    "PYTORCH_TRANSFORMERS_CACHE": None,
    "MPLCONFIGDIR": "matplotlib",
}
_user_environment: dict[str, str | None] = {}
_session_caches: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    """Point the libraries' caches at a new folder of this session (removed when it ends)."""
    folder = Path(tempfile.mkdtemp(prefix="streampack-tests-caches-")).resolve()
    _session_caches.append(folder)
    for name, under in CACHES.items():
        _user_environment.setdefault(name, os.environ.get(name))
        if under is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(folder / under)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give the environment back as it was, and remove the session's caches."""
    for name, value in _user_environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for folder in _session_caches:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE tokenizer.json trained on the fly, with <|endoftext|> as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def gpt2_tokenizer() -> Path:
    """The real GPT-2 tokenizer.json from ../shared/data (skips where absent)."""
    if not GPT2_JSON.exists():
        pytest.skip(f"GPT-2 tokenizer not found at {GPT2_JSON} (../shared/data is absent)")
    return GPT2_JSON


@pytest.fixture(scope="session")
def tiktoken_gpt2() -> Path:
    """The real tiktoken GPT-2 ranks file from ../shared/data (skips where absent or without tiktoken)."""
    pytest.importorskip("tiktoken")
    if not TIKTOKEN_GPT2.exists():
        pytest.skip(f"tiktoken ranks not found at {TIKTOKEN_GPT2} (../shared/data is absent)")
    return TIKTOKEN_GPT2


def write_jsonl(path: Path, records: Sequence[object]) -> Path:
    """Write one JSON value per line (compressed by the path's extension)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    return write_bytes(path, data)


def write_bytes(path: Path, data: bytes) -> Path:
    """Write bytes, compressing by extension (.gz, .zst, .bz2, .xz)."""
    import bz2
    import gzip
    import lzma

    import zstandard

    compress = {
        ".gz": lambda d: gzip.compress(d, mtime=0),
        ".zst": lambda d: zstandard.ZstdCompressor().compress(d),
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
    }.get(path.suffix, lambda d: d)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(compress(data))
    return path


def run_cli(
    *args: str | os.PathLike[str], check: bool = True, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``streampack ARGS`` in a subprocess, as a user would (in the directory ``cwd``)."""
    cmd = [sys.executable, "-m", "streampack", *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def shard_bytes(root: Path) -> dict[str, bytes]:
    """Every file of a cache except the lock, by relative path: for byte-for-byte comparisons."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "build.lock"
    }


# ----------------------------------------------------------------------------- object storage (S3)

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server on 127.0.0.1 (dummy credentials in the environment meanwhile)."""
    moto_server = pytest.importorskip(
        "moto.server", reason="the S3 tests need moto[server] (the dev extra has it)"
    )
    saved = {key: os.environ.get(key) for key in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> tuple[Any, str]:
    """A new, empty bucket: its s3fs filesystem and its name."""
    s3fs = pytest.importorskip("s3fs", reason="the S3 tests need s3fs (the dev extra has it)")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    name = "b" + format(abs(hash(request.node.nodeid)), "x")[:20]
    fs.mkdir(name)
    return fs, name


def s3_options(endpoint: str) -> dict[str, Any]:
    """The storage options of the test server."""
    return {"client_kwargs": {"endpoint_url": endpoint}}


# ----------------------------------------------------------------------------- manifests


def set_shard_checksum(manifest: dict, shard: int, column: str, checksum: str) -> None:
    """Record ``checksum`` (``crc32:xxxxxxxx``) as shard ``shard``'s in the checksum ``column``
    (``tokens_crc32``, ``offsets_crc32``, ``mask_crc32``) of a parsed version 2 manifest."""
    digits = manifest["shards"][column]
    at = 8 * shard
    manifest["shards"][column] = digits[:at] + checksum.removeprefix("crc32:") + digits[at + 8 :]


def as_version_1(manifest: dict) -> dict:
    """A parsed version 2 manifest as streampack wrote it in version 1: its shard table as rows."""
    table, rows = manifest["shards"], []
    for index, (docs, tokens) in enumerate(zip(table["num_docs"], table["num_tokens"])):
        row = {"name": f"{index:06d}", "unit": manifest["units"][index], "num_docs": docs}
        row["num_tokens"] = tokens
        for field in ("tokens", "offsets", "mask"):
            digits = table.get(f"{field}_crc32", "absent")
            if digits != "absent":
                at = 8 * index
                row[f"{field}_checksum"] = "" if digits is None else f"crc32:{digits[at : at + 8]}"
        rows.append(row)
    return {**manifest, "format_version": 1, "shards": rows}


@pytest.fixture(scope="session")
def natural(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer: Path) -> streampack.Cache:
    """The real sample corpus with the GPT-2 tokenizer, in about a dozen shards."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"sample corpus not found at {SAMPLE_CORPUS}")
    tmp = tmp_path_factory.mktemp("natural")
    text = zstandard.ZstdDecompressor().stream_reader(SAMPLE_CORPUS.open("rb")).read()
    (tmp / "natural.jsonl").write_bytes(text)
    out = tmp / "cache"
    streampack.build(tmp / "natural.jsonl", out, tokenizer=str(gpt2_tokenizer), unit_bytes=1 << 20)
    cache = streampack.open(out)
    assert cache.num_shards > 5
    return cache


@pytest.fixture(scope="session")
def sft(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer: Path) -> streampack.Cache:
    """A small SFT cache: prompt/response fields, a loss mask on the responses and EOS."""
    tmp = tmp_path_factory.mktemp("sft")
    records = [
        {"prompt": f"Question {i}: what is {i} + {i}?", "response": f"It is {2 * i}."} for i in range(300)
    ]
    src = write_jsonl(tmp / "sft.jsonl", records)
    streampack.build(src, tmp / "cache", tokenizer=str(bpe_tokenizer), fields=["prompt", "response"])
    cache = streampack.open(tmp / "cache")
    assert cache.has_loss_mask
    return cache


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """mosaicml-streaming, importable with the torchvision stub (tests/stubs) on sys.path.

    The stub leaves ``sys.modules`` after the test, and transformers (which streaming imports) forgets that
    it saw a torchvision: else a later test of the same process that loads a model imports the stub's
    missing ``InterpolationMode``.
    """
    monkeypatch.syspath_prepend(str(STUBS))
    yield pytest.importorskip("streaming")
    if str(STUBS) in str(getattr(sys.modules.get("torchvision"), "__file__", "")):
        for name in [name for name in sys.modules if name.partition(".")[0] == "torchvision"]:
            del sys.modules[name]
    import_utils = sys.modules.get("transformers.utils.import_utils")
    if import_utils is not None:
        import_utils.is_torchvision_available.cache_clear()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real HTTP server on 127.0.0.1 serving a fresh folder: (the folder, its base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def megatron_export(natural: streampack.Cache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``natural`` exported as a Megatron pair: the prefix of its ``.bin`` and ``.idx``."""
    prefix = tmp_path_factory.mktemp("megatron") / "corpus"
    natural.export("megatron", prefix)
    return prefix


def in_threads(read: Callable[..., None], arguments: Sequence[tuple[Any, ...]]) -> None:
    """Run ``read`` once per tuple of ``arguments``, each in its own thread, switching threads often (as a
    busy trainer beside a prefetch thread does), until all have ended."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=read, args=args) for args in arguments]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
