"""The manifest's sections are typed records that keep the bytes: a manifest read and written again is the
file it was, and the build identity and digest computed from it are those of 0.2.0, when they were dicts.

The golden manifests under ``tests/fixtures/manifests`` were written by 0.1.0 and 0.2.0, and their expected
identity, digest and rewritten bytes computed by 0.2.0 (``make.py`` there says how).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import CacheError
from streampack.format import Manifest, build_digest, build_identity, parse_manifest, with_checksum
from streampack.format.sections import (
    BosPolicy,
    BuildSettings,
    Cuts,
    EngineRecord,
    EosPolicy,
    IgnoredEntry,
    IgnoredInputs,
    InputRecord,
    InputRecords,
    Section,
    TokenizerInfo,
    Verification,
)
from streampack.store import encode_json
from tests.conftest import GPT2_JSON, TIKTOKEN_GPT2

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "manifests"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def _make_module() -> Any:
    spec = importlib.util.spec_from_file_location("manifest_fixtures", FIXTURES / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _make_module()


def rewritten(manifest: Manifest) -> bytes:
    """The bytes ``store.files.write_manifest`` writes for ``manifest``."""
    return encode_json(with_checksum(manifest.to_json()))


# ------------------------------------------------------------------------------ manifests of 0.1 and 0.2


def test_the_fixtures_cover_every_kind_and_both_versions() -> None:
    names = set(EXPECTED)
    assert {f"0.2.0-{kind}" for kind in MAKE.KINDS} <= names
    assert len([n for n in names if n.startswith("0.1.0-")]) >= 10


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_manifest_written_before_reads_and_writes_back_as_0_2_did(name: str) -> None:
    """Written by 0.1.0 or 0.2.0: parsed and written again, the bytes 0.2.0 wrote back (the file itself,
    but for a version 1 manifest, which is written as version 2); the identity and digest 0.2.0 computed."""
    data = (FIXTURES / f"{name}.json").read_bytes()
    expected = EXPECTED[name]
    manifest = parse_manifest(json.loads(data), name)
    again = rewritten(manifest)
    assert hashlib.sha256(again).hexdigest() == expected["rewritten_sha256"]
    assert (again == data) is expected["rewritten_is_the_file"]
    assert build_identity(manifest) == expected["identity"]
    assert build_digest(manifest) == expected["digest"]
    assert parse_manifest(json.loads(again), name) == manifest  # and once more: a fixed point


def identity_as_0_2(raw: dict[str, Any]) -> dict[str, Any]:
    """``build_identity`` as 0.2.0 computed it, over the manifest's JSON (its sections were dicts)."""
    tokenizer = {k: v for k, v in raw["tokenizer"].items() if k != "spec"}
    settings = {k: v for k, v in raw["settings"].items() if k != "tokenizer"}
    for key, value in {"bos": False, "bos_id": None, "fields": None, "chat": None}.items():
        settings.setdefault(key, value)
    bos = raw.get("bos", {"prepend": False, "id": None})
    return {
        "tokenizer": tokenizer,
        "dtype": raw["dtype"],
        "eos_policy": raw["eos"],
        "bos_policy": bos,
        **settings,
    }


def digest_as_0_2(raw: dict[str, Any]) -> str:
    """``build_digest`` as 0.2.0 computed it, over the manifest's JSON."""
    fields = {
        "identity": identity_as_0_2(raw),
        "inputs": raw["inputs"],
        "units": raw["units"],
        "loss_mask": raw.get("loss_mask", False),
    }
    return hashlib.blake2b(
        json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16
    ).hexdigest()


LIVE_KINDS = [kind for kind in MAKE.KINDS if kind != "remote"]  # the fixtures hold a remote build's


@pytest.mark.parametrize("kind", LIVE_KINDS)
def test_a_manifest_built_now_reads_and_writes_back_its_bytes(kind: str, tmp_path: Path) -> None:
    """Each kind of cache built now (plain, SFT fields and chat, BOS, Parquet, tiktoken, ...): its manifest
    parsed and written again is the file, and its identity and digest are 0.2.0's over the same JSON."""
    if kind in ("gpt2-bos", "sft-chat", "parquet", "parse-specials") and not GPT2_JSON.exists():
        pytest.skip("the GPT-2 tokenizer of ../shared/data is absent")
    if kind == "tiktoken" and not TIKTOKEN_GPT2.exists():
        pytest.skip("the tiktoken ranks of ../shared/data are absent")
    MAKE.KINDS[kind](streampack, tmp_path)
    data = (tmp_path / "cache" / "manifest.json").read_bytes()
    raw = json.loads(data)
    manifest = parse_manifest(raw, "manifest.json")
    if kind == "version-1":  # written back as version 2: only the version and the shard table change
        again, moved = json.loads(rewritten(manifest)), ("checksum", "format_version", "shards")
        assert {k: v for k, v in again.items() if k not in moved} == {
            k: v for k, v in raw.items() if k not in moved
        }
    else:
        assert rewritten(manifest) == data
    assert build_identity(manifest) == identity_as_0_2(raw)
    assert build_digest(manifest) == digest_as_0_2(raw)


def test_the_built_manifest_is_typed(tmp_path: Path) -> None:
    MAKE.KINDS["sft-fields"](streampack, tmp_path)
    manifest = streampack.open(tmp_path / "cache").manifest
    assert manifest.tokenizer == TokenizerInfo(
        "bytes", "bytes", 257, sha256="bytes-v1", spec="bytes", cuts=Cuts(True, "every cut keeps UTF-8 bytes")
    )
    assert manifest.eos == EosPolicy(True, 256) and manifest.bos == BosPolicy(False, None)
    assert manifest.settings.fields == ("prompt", "response") and manifest.settings.sft
    assert manifest.settings.unit_bytes == 64 << 20 and manifest.settings.special_tokens == "text"
    (source,) = manifest.inputs
    assert source.path.endswith("sft.jsonl") and source.mtime_ns == MAKE.MTIME * 10**9 and not source.python
    assert manifest.engines == [EngineRecord("bytes", "1", "bytes 1", "the bytes tokenizer's only engine")]
    assert not manifest.ignored_inputs


# ------------------------------------------------------------------------------ refusing malformed sections


def _edited(tmp_path: Path, edit: Any) -> Path:
    MAKE.KINDS["plain"](streampack, tmp_path)
    path = tmp_path / "cache" / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    raw.pop("checksum")
    path.write_bytes(encode_json(with_checksum(raw)))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            lambda m: m["tokenizer"].update(vocab_size="257"),
            r"Expected `int`, got `str` - at `\$\.tokenizer\.vocab_size`",
        ),
        (lambda m: m["tokenizer"].pop("kind"), r"missing required field `kind` - at `\$\.tokenizer`"),
        (
            lambda m: m["tokenizer"].update(cuts={"exact": True}),
            r"missing required field `reason` - at `\$\.tokenizer\.cuts`",
        ),
        (lambda m: m["eos"].pop("append"), r"missing required field `append` - at `\$\.eos`"),
        (lambda m: m["eos"].update(id=None), r"eos\.id must be a non-negative integer when append is true"),
        (lambda m: m["bos"].update(prepend=1), r"Expected `bool`, got `int` - at `\$\.bos\.prepend`"),
        (
            lambda m: m["settings"].update(unit_bytes="64M"),
            r"Expected `int`, got `str` - at `\$\.settings\.unit_bytes`",
        ),
        (
            lambda m: m["settings"].update(fields="text"),
            r"Expected `array \| null`, got `str` - at `\$\.settings\.fields`",
        ),
        (lambda m: m["inputs"][0].pop("path"), r"missing required field `path` - at `\$\.inputs\[0\]`"),
        (
            lambda m: m["inputs"][0].update(size=-1),
            r"Expected `int` >= 0, got `-1` - at `\$\.inputs\[0\]\.size`",
        ),
        (
            lambda m: m.update(engines=[{"name": "bytes"}]),
            r"missing required field `version` - at `\$\.engines\[0\]`",
        ),
        (
            lambda m: m.update(ignored_inputs={"count": "3"}),
            r"Expected `int`, got `str` - at `\$\.ignored_inputs\.count`",
        ),
        (lambda m: m.update(settings=[]), r"Expected `object`, got `array` - at `\$\.settings`"),
    ],
)
def test_a_missing_or_mistyped_field_is_a_cache_error_naming_file_and_field(
    tmp_path: Path, edit: Any, named: str
) -> None:
    root = _edited(tmp_path, edit)
    with pytest.raises(CacheError, match=named) as refused:
        streampack.open(root)
    assert str(root / "manifest.json") in str(refused.value) and "rebuild the cache" in str(refused.value)


def test_keys_a_later_version_adds_are_kept_and_compared(tmp_path: Path) -> None:
    """A key this version does not know (in any section) is kept where it stood, written back, and part of
    the identity: a later version's setting may change the bytes."""

    def later(raw: dict[str, Any]) -> None:
        raw["tokenizer"] = {"added": [1, 2], **raw["tokenizer"]}
        raw["settings"]["dedupe"] = "exact"
        raw["inputs"][0]["etag"] = "abc"
        raw["eos"]["weight"] = 0.5

    root = _edited(tmp_path, later)
    data = (root / "manifest.json").read_bytes()
    manifest = streampack.open(root).manifest
    assert rewritten(manifest) == data
    assert next(iter(manifest.tokenizer.to_json())) == "added" and manifest.tokenizer.extra == {
        "added": [1, 2]
    }
    assert manifest.settings.extra == {"dedupe": "exact"} and manifest.inputs[0].extra == {"etag": "abc"}
    assert build_identity(manifest)["dedupe"] == "exact"
    assert build_identity(manifest) == identity_as_0_2(json.loads(data))


# ------------------------------------------------------------------------------ the policies' two homes


def test_the_policies_are_the_tokenizer_packages_too() -> None:
    from streampack.tokenizer import specials

    assert specials.EosPolicy is EosPolicy and specials.BosPolicy is BosPolicy
    assert EosPolicy(True, 5).to_json() == {"append": True, "id": 5} and hash(EosPolicy(True, 5))


# ------------------------------------------------------------------------------ round trips, by hypothesis

names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
texts = st.text(max_size=20)
counts = st.integers(0, 2**63 - 1)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def json_object(
    draw: st.DrawFn, cls: type[Section], required: dict[str, Any], optional: dict[str, Any]
) -> dict:
    """A JSON object of section ``cls``: its required keys, some optional ones, some unknown, in any order."""
    items = {key: draw(value) for key, value in required.items()}
    items |= {key: draw(value) for key, value in optional.items() if draw(st.booleans())}
    known = {f.name for f in dataclasses.fields(cls)}
    extra = draw(st.dictionaries(names.filter(lambda n: n not in known), json_values, max_size=2))
    keys = draw(st.permutations([*items, *extra]))
    return {key: items[key] if key in items else extra[key] for key in keys}


def nullable(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | values


cuts = json_object(Cuts, {"exact": st.booleans(), "reason": texts}, {})
verification = json_object(Verification, {"mode": texts}, {"first": counts, "rate": st.floats(0, 1)})
SECTIONS: dict[type[Section], st.SearchStrategy[dict]] = {
    TokenizerInfo: json_object(
        TokenizerInfo,
        {"kind": texts, "name": texts, "vocab_size": st.integers(1, 2**32)},
        {"sha256": texts, "spec": texts, "cuts": cuts, "chat_template_sha256": texts},
    ),
    EosPolicy: json_object(EosPolicy, {"append": st.just(False)}, {"id": nullable(counts)})
    | json_object(EosPolicy, {"append": st.just(True), "id": counts}, {}),
    BosPolicy: json_object(BosPolicy, {"prepend": st.just(False)}, {"id": nullable(counts)})
    | json_object(BosPolicy, {"prepend": st.just(True), "id": counts}, {}),
    BuildSettings: json_object(
        BuildSettings,
        {},
        {
            "tokenizer": texts,
            "special_tokens": st.sampled_from(["text", "parse"]),
            "eos": st.booleans(),
            "eos_id": nullable(counts),
            "bos": st.booleans(),
            "bos_id": nullable(counts),
            "text_field": texts,
            "split_lines": st.booleans(),
            "unit_bytes": counts,
            "max_piece_chars": nullable(counts),
            "fields": nullable(st.lists(names, max_size=3)),
            "chat": nullable(texts),
        },
    ),
    InputRecord: json_object(
        InputRecord,
        {"path": texts},
        {"size": nullable(counts), "mtime_ns": nullable(st.integers()), "fingerprint": nullable(texts)},
    ),
    EngineRecord: json_object(
        EngineRecord,
        {"name": texts, "version": texts},
        {"reference": texts, "why": texts, "verify": verification},
    ),
    IgnoredInputs: json_object(
        IgnoredInputs,
        {},
        {
            "count": counts,
            "by_reason": st.dictionaries(texts, counts, max_size=3),
            "first": st.lists(json_object(IgnoredEntry, {"path": texts, "reason": texts}, {}), max_size=3),
        },
    ),
}


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda cls: cls.__name__)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_section_writes_back_the_json_it_was_read_from(cls: type[Section], data: st.DataObject) -> None:
    """Any valid JSON object of a section, with keys absent, unknown keys and any order: read and written
    back, the same object with its keys in the same order; equal to itself read again; hashable."""
    raw = data.draw(SECTIONS[cls])
    section = cls.from_json(raw)
    written = section.to_json()
    assert written == raw and list(written) == list(raw)
    assert json.dumps(written) == json.dumps(raw)
    again = cls.from_json(written)
    assert again == section and hash(again) == hash(section)
    assert dataclasses.replace(section) == section and dataclasses.replace(section).to_json() == raw


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda cls: cls.__name__)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_section_made_in_code_reads_back_equal(cls: type[Section], data: st.DataObject) -> None:
    """The same section made in code (as the builder makes it, no key order recorded): what it writes reads
    back equal, and it writes the keys of a section made so, known keys first, in their order."""
    read = cls.from_json(data.draw(SECTIONS[cls]))
    made = dataclasses.replace(read, json_keys=None)
    written = made.to_json()
    assert cls.from_json(written) == made
    known = [f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "json_keys")]
    assert [k for k in written if k in known] == [k for k in known if k in written]
    assert list(written)[len([k for k in written if k in known]) :] == list(made.extra)


input_values = st.none() | st.booleans() | st.integers(-3, 2**63) | texts | st.floats(allow_nan=False)
input_objects = st.dictionaries(
    st.sampled_from(["path", "size", "mtime_ns", "fingerprint", "etag"]), input_values
)


@settings(max_examples=300, deadline=None)
@given(raws=st.lists(input_objects | json_object(InputRecord, {"path": texts}, {"size": counts}), max_size=6))
def test_the_inputs_checked_as_a_whole_are_those_each_record_accepts(raws: list[dict[str, Any]]) -> None:
    """A manifest's inputs are checked as a whole (10^5 inputs open fast): that check
    accepts exactly the lists whose every object reads as an InputRecord, and refuses with its message."""
    try:
        expected = [InputRecord.from_json(raw, name=f"inputs[{i}]") for i, raw in enumerate(raws)]
    except CacheError as refused:
        with pytest.raises(CacheError) as also:
            InputRecords.from_json(raws)
        assert str(also.value) == str(refused)
    else:
        inputs = InputRecords.from_json(raws)
        assert list(inputs) == expected and inputs.to_json() == raws and len(inputs) == len(raws)
        assert inputs[-1:] == expected[-1:] and inputs == expected
