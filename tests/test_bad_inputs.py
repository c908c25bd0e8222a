"""The bad-input catalogue: every kind of bad input, the message the user sees, and that nothing is lost.

Each case is a test, and a row of docs/ERRORS.md; regenerate that page after changing a message with
``python -m tests.test_bad_inputs``.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.conftest import run_cli

ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md"
GOOD = b"".join(b'{"text": "good record %d"}\n' % i for i in range(2000))
GOOD_SFT = b"".join(b'{"prompt": "question %d", "response": "answer"}\n' % i for i in range(2000))
SFT = ("--fields", "prompt,response")


@dataclass(frozen=True)
class Case:
    """One kind of bad input: the file to write, and either an error or the documents that result."""

    kind: str
    name: str
    data: bytes | None
    error: str | None = None  # regex the error message must match
    docs: int | None = None  # documents in the cache when the input is accepted
    skip_docs: int | None = None  # documents with --on-bad-record skip (record-level problems only)
    args: tuple[str, ...] = field(default=())
    symlink: str | None = None  # make the input a symlink to this path instead of writing data
    as_given: bool = False  # pass the name itself (e.g. "-"), not a file in a temporary directory


def _cut(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def _corrupt(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0x5A for b in data[middle : middle + 64]) + data[middle + 64 :]


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _invalid_utf8_strings(values: list[bytes]) -> pa.Array:
    """A string array holding the bytes as they are (pyarrow validates nothing when built from buffers)."""
    binary = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(values), binary.buffers())


ZSTD = zstandard.ZstdCompressor().compress
CASES = [
    Case(
        "malformed JSON",
        "a.jsonl",
        GOOD + b'{"text": "oops\n',
        r"a\.jsonl:2001: malformed JSON",
        skip_docs=2000,
    ),
    Case(
        "JSON nested too deeply",
        "a.jsonl",
        GOOD + b'{"meta": ' + b"[" * 1100 + b"]" * 1100 + b', "text": "deep"}\n' + b'{"text": "last"}\n',
        r"a\.jsonl:2001: malformed JSON \(nested too deeply\)\. Fix the record",
        skip_docs=2001,
    ),
    Case(
        "JSON value not an object",
        "a.jsonl",
        b'"just a string"\n' + GOOD,
        r"a\.jsonl:1: the line is a JSON str",
        skip_docs=2000,
    ),
    Case(
        "missing text field",
        "a.jsonl",
        GOOD + b'{"body": "x"}\n',
        r"a\.jsonl:2001: no 'text' field \(fields: 'body'\)",
        skip_docs=2000,
    ),
    Case(
        "non-string text field",
        "a.jsonl",
        b'{"text": ["a"]}\n' + GOOD,
        r"a\.jsonl:1: the 'text' field is list",
        skip_docs=2000,
    ),
    Case(
        "null text field",
        "a.jsonl",
        b'{"text": null}\n' + GOOD,
        r"a\.jsonl:1: the 'text' field is null",
        skip_docs=2000,
    ),
    Case(
        "invalid UTF-8 in JSONL",
        "a.jsonl",
        GOOD + b'{"text": "caf\xe9"}\n',
        r"a\.jsonl:2001: invalid UTF-8 at byte 13",
        skip_docs=2000,
    ),
    Case(
        "invalid UTF-8 in a text line",
        "a.txt",
        b"ok\n\xff\xfe\nok\n",
        r"a\.txt:2: invalid UTF-8",
        skip_docs=2,
        args=("--split-lines",),
    ),
    Case("invalid UTF-8 in a text file", "a.txt", b"ok \xff", r"a\.txt: byte 3: invalid UTF-8", skip_docs=0),
    Case(
        "invalid UTF-8 in a large (streamed) text file",
        "a.txt",
        b"word " * (2 << 20) + b"\xff",
        r"a\.txt: byte 10485760: invalid UTF-8",
        skip_docs=0,
    ),
    Case(
        "embedded NUL byte in JSON",
        "a.jsonl",
        b'{"text": "a\x00b"}\n',
        r"a\.jsonl:1: malformed JSON",
        skip_docs=0,
    ),
    Case("escaped NUL in JSON text (accepted)", "a.jsonl", b'{"text": "a\\u0000b"}\n', docs=1),
    Case("UTF-8 BOM (stripped)", "a.jsonl", b"\xef\xbb\xbf" + GOOD, docs=2000),
    Case("CRLF line ends (accepted)", "a.jsonl", GOOD.replace(b"\n", b"\r\n"), docs=2000),
    Case("blank lines (ignored)", "a.jsonl", b"\n" + GOOD + b"\n  \n", docs=2000),
    Case(
        "truncated gzip",
        "a.jsonl.gz",
        _cut(gzip.compress(GOOD)),
        r"a\.jsonl\.gz(:\d+|: before the first line): the gzip stream is truncated",
    ),
    Case(
        "corrupt gzip",
        "a.jsonl.gz",
        _corrupt(gzip.compress(GOOD * 4)),
        # gzip checks its CRC only at the end: the garbage before it is usually reported first, unless
        # the whole file is read at once (the lines are read in parts of 1 MiB)
        r"a\.jsonl\.gz(:\d+|: before the first line): "
        r"(the gzip stream is truncated or corrupt|malformed JSON)",
    ),
    Case(
        "truncated zstd",
        "a.jsonl.zst",
        _cut(ZSTD(GOOD)),
        r"a\.jsonl\.zst(:\d+|: before the first line): the zstd stream is truncated",
    ),
    Case(
        "corrupt zstd",
        "a.jsonl.zst",
        _corrupt(ZSTD(GOOD * 4)),
        r"a\.jsonl\.zst(:\d+|: before the first line): the zstd stream is truncated or corrupt",
    ),
    Case(
        "truncated bz2",
        "a.jsonl.bz2",
        _cut(bz2.compress(GOOD)),
        r"a\.jsonl\.bz2(:\d+|: before the first line): the bz2 stream is truncated",
    ),
    Case(
        "truncated xz",
        "a.jsonl.xz",
        _cut(lzma.compress(GOOD)),
        r"a\.jsonl\.xz(:\d+|: before the first line): the xz stream is truncated",
    ),
    Case("zero-byte file (accepted, no documents)", "a.jsonl", b"", docs=0),
    Case(
        "empty and whitespace-only texts (left out and counted)",
        "a.jsonl",
        b'{"text": ""}\n{"text": " \\n\\t "}\n{"text": "kept"}\n',
        docs=1,
    ),
    Case(
        "Parquet without the text column",
        "a.parquet",
        _parquet(pa.table({"body": ["x"]})),
        r"a\.parquet: no column 'text' \(columns: body\); pass --text-field",
    ),
    Case(
        "Parquet text column not a string",
        "a.parquet",
        _parquet(pa.table({"text": [1, 2]})),
        r"a\.parquet: column 'text' has type int64, expected string",
    ),
    Case(
        "Parquet null text",
        "a.parquet",
        _parquet(pa.table({"text": ["a", None, "b"]})),
        r"a\.parquet: row 2: the 'text' value is null",
        skip_docs=2,
    ),
    Case(
        "Parquet corrupt footer",
        "a.parquet",
        _parquet(pa.table({"text": ["a"]}))[:-12],
        r"a\.parquet: not a readable Parquet file",
    ),
    Case(
        "Parquet invalid UTF-8 in the text column",
        "a.parquet",
        _parquet(pa.table({"text": _invalid_utf8_strings([b"ok", b"bad \xff\xfe", b"fine"])})),
        r"a\.parquet: row 2: invalid UTF-8 at byte 4 of the value",
        skip_docs=2,
    ),
    Case(
        "Parquet dictionary-encoded text (accepted)",
        "a.parquet",
        _parquet(pa.table({"text": pa.array(["a", "b", "a"]).dictionary_encode()})),
        docs=3,
    ),
    Case(
        "Parquet string_view text (accepted)",
        "a.parquet",
        _parquet(pa.table({"text": pa.array(["a", "b"], pa.string_view())})),
        docs=2,
    ),
    Case(
        "Parquet nested text field (accepted)",
        "a.parquet",
        _parquet(pa.table({"meta": pa.array([{"text": "a", "n": 1}, {"text": "b", "n": 2}])})),
        docs=2,
        args=("--text-field", "meta.text"),
    ),
    Case(
        "Parquet nested text field missing",
        "a.parquet",
        _parquet(pa.table({"meta": pa.array([{"body": "a"}])})),
        r"a\.parquet: no column 'meta\.text': 'meta' has no field 'text' \(fields: body\)",
        args=("--text-field", "meta.text"),
    ),
    Case(
        "nested JSON text field (accepted)",
        "a.jsonl",
        b'{"meta": {"text": "a"}}\n{"meta.text": "a literal key is preferred", "meta": {}}\n',
        docs=2,
        args=("--text-field", "meta.text"),
    ),
    Case(
        "nested JSON text field missing",
        "a.jsonl",
        GOOD.replace(b'"text"', b'"meta": {"text"').replace(b"}\n", b"}}\n") + b'{"meta": {"body": "x"}}\n',
        r"a\.jsonl:2001: no 'meta\.text' field: 'meta' has no 'text' \(its fields: 'body'\)",
        skip_docs=2000,
        args=("--text-field", "meta.text"),
    ),
    Case(
        "NaN and Infinity in other fields (accepted)",
        "a.jsonl",
        b'{"text": "a", "score": NaN}\n{"text": "b", "score": -Infinity}\n',
        docs=2,
    ),
    Case(
        "lone surrogate escape in the text",
        "a.jsonl",
        GOOD + b'{"text": "bad \\ud800 text"}\n',
        r"a\.jsonl:2001: the text holds a lone surrogate at character 4",
        skip_docs=2000,
    ),
    Case(
        "lone surrogate escape in another field (accepted)",
        "a.jsonl",
        b'{"text": "a", "note": "\\udc00"}\n',
        docs=1,
    ),
    Case(
        "a JSON document, not JSON Lines",
        "config.json",
        b'{\n  "text": "a pretty-printed document"\n}\n',
        r"config\.json:1: malformed JSON .*this looks like a single JSON document, not JSON Lines",
    ),
    Case(
        "gzip data named .jsonl",
        "a.jsonl",
        gzip.compress(GOOD),
        r"a\.jsonl: the file looks gzip-compressed but is named \.jsonl; rename it to a\.jsonl\.gz",
    ),
    Case(
        "zstd data named .txt",
        "a.txt",
        ZSTD(b"some text"),
        r"a\.txt: the file looks zstd-compressed but is named \.txt; rename it to a\.txt\.zst",
    ),
    Case(
        "I/O error reading a text file",
        "a.txt",
        None,
        r"a\.txt: cannot read \(\[Errno 5\] Input/output error\)",
        symlink="/proc/self/mem",
    ),
    Case(
        "missing field of an SFT record (--fields)",
        "a.jsonl",
        GOOD_SFT + b'{"prompt": "x"}\n',
        r"a\.jsonl:2001: no 'response' field \(fields: 'prompt'\); pass --fields A,B to choose another",
        skip_docs=2000,
        args=SFT,
    ),
    Case(
        "non-string field of an SFT record (--fields)",
        "a.jsonl",
        b'{"prompt": "x", "response": {"text": "y"}}\n' + GOOD_SFT,
        r"a\.jsonl:1: the 'response' field is dict, expected a string",
        skip_docs=2000,
        args=SFT,
    ),
    Case(
        "text file in an SFT build (--fields, --chat)",
        "a.txt",
        b"just text\n",
        r"a\.txt: a text file holds no fields to build with --fields A,B; give JSONL, Parquet or Python",
        args=SFT,
    ),
    Case("unknown extension", "a.csv", b"text\nx\n", r"a\.csv: unknown file type \(supported: "),
    Case("missing input file", "missing.jsonl", None, r"missing\.jsonl: no such file or directory"),
    Case(
        "standard input",
        "-",
        None,
        r"-: reading from standard input is not supported; save it to a file first",
        as_given=True,
    ),
    Case(
        "a device, not a file",
        "/dev/null",
        None,
        r"/dev/null: a character device, not a regular file or directory",
        as_given=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input(case: Case, tmp_path: Path) -> None:
    result = run_case(case, tmp_path, "error")
    if case.error is None:
        assert result.returncode == 0, result.stderr
        assert f" {case.docs:,} documents" in result.stdout
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert re.search(case.error, result.stderr), result.stderr
    if case.skip_docs is not None:
        skipped = run_case(case, tmp_path, "skip")
        assert skipped.returncode == 0, skipped.stderr
        assert (
            f" {case.skip_docs:,} documents" in skipped.stdout and "skipped 1 bad record " in skipped.stdout
        )


def run_case(case: Case, tmp_path: Path, policy: str) -> subprocess.CompletedProcess:
    path = Path(case.name) if case.as_given else tmp_path / case.name
    if case.data is not None:
        path.write_bytes(case.data)
    elif case.symlink is not None and not path.is_symlink():
        path.symlink_to(case.symlink)
    out = tmp_path / ("cache" if policy == "error" else "cache-skip")
    return run_cli("build", path, "--out", out, "--on-bad-record", policy, *case.args, check=False)


def test_input_changed_since_the_ledger_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_bytes(GOOD + b"not json\n")
    out = tmp_path / "c"
    assert run_cli("build", src, "--out", out, check=False).returncode == 1  # stops, with 2000 committed
    src.write_bytes(GOOD + b'{"text": "fixed"}\n')
    result = run_cli("build", src, "--out", out, check=False)
    assert result.returncode == 1
    assert (
        "the inputs changed since the ledger was written" in result.stderr
        and "size 56899 -> 56908" in result.stderr
    )
    assert "--overwrite" in result.stderr
    assert " 2,001 documents" in run_cli("build", src, "--out", out, "--overwrite").stdout


def test_error_catalogue_is_documented() -> None:
    documented = ERRORS_DOC.read_text()
    missing = [c.kind for c in CASES if f"| {c.kind} |" not in documented]
    assert not missing, f"docs/ERRORS.md lacks {missing}: run python -m tests.test_bad_inputs"


def write_errors_doc() -> None:
    """Regenerate docs/ERRORS.md by running every case and recording what the user sees."""
    import tempfile

    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_case(case, Path(tmp), "error")
            shown = (result.stderr or result.stdout).strip().replace(tmp + "/", "").replace("|", "\\|")
            shown = re.sub(r", [0-9.]+ s$", "", shown)
            skip = "" if case.skip_docs is None else "skipped and counted"
        rows.append(f"| {case.kind} | `{case.name}` | {shown} | {skip} |")
    header = (
        "# What streampack says about bad input\n\n"
        "Every row is a test in `tests/test_bad_inputs.py` (regenerate this page with "
        "`python -m tests.test_bad_inputs`). Errors exit with status 1 and leave everything committed\n"
        "before the bad record in place: fix the input (or add `--on-bad-record skip`) and rerun.\n"
        "Rows marked *skipped and counted* are record-level problems that `--on-bad-record skip` skips,\n"
        "printing the count and storing it in the manifest (`skipped_records`).\n\n"
        "| kind | file | what the user sees | with `--on-bad-record skip` |\n|---|---|---|---|\n"
    )
    handwritten = ERRORS_DOC.read_text().partition("\n## Other refusals")
    tail = handwritten[1] + handwritten[2] if handwritten[1] else ""
    ERRORS_DOC.write_text(header + "\n".join(rows) + "\n" + tail)


if __name__ == "__main__":
    write_errors_doc()
    sys.exit(0)
