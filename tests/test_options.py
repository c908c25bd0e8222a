"""Build settings: what identifies a cache is recorded whole and checked on resume; run options never are."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import streampack
from streampack.builder.executors import worker_threads
from streampack.builder.options import CacheSpec, RunOptions, split_options
from streampack.errors import ConfigMismatchError, OptionsError
from tests.conftest import write_jsonl


def test_a_misspelt_option_is_refused_with_the_nearest_name(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match="unknown build option 'worker'; did you mean 'workers'"):
        streampack.build(streampack.Documents(["x"]), tmp_path / "c", worker=2)
    # The same for the settings given whole, as the README shows: build(..., spec=CacheSpec(...)).
    with pytest.raises(OptionsError, match="CacheSpec has no field 'tokeniser'; did you mean 'tokenizer'"):
        CacheSpec(tokeniser="bytes")  # type: ignore[call-arg]
    with pytest.raises(OptionsError, match="RunOptions has no field 'worker'; did you mean 'workers'"):
        RunOptions(worker=2)  # type: ignore[call-arg]
    assert CacheSpec("bytes", eos=False) == dataclasses.replace(CacheSpec(), eos=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"text_field": ""}, "text_field must be a non-empty string"),
        ({"eos": False, "eos_id": 3}, "eos_id=3 contradicts eos=False"),
        ({"special_tokens": "maybe"}, "special_tokens must be one of 'text', 'parse'"),
        ({"workers": 0}, r"workers must be an integer >= 1, or None \(got workers=0\)"),
        ({"executor": "spark"}, "executor must be one of 'local', 'ray'"),
        # A truthy string would be recorded in the manifest as given, and the cache not read back.
        ({"eos": "append"}, r"eos must be True or False \(got eos='append'\)"),
        ({"split_lines": 1}, r"split_lines must be True or False \(got split_lines=1\)"),
        ({"overwrite": "yes"}, r"overwrite must be True or False"),
    ],
)
def test_bad_values_are_option_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        split_options(None, None, options)


def test_the_spec_is_recorded_whole_and_run_options_never(tmp_path: Path) -> None:
    streampack.build(
        streampack.Documents(["a b"]), tmp_path / "c", workers=1, text_field="body", progress=False
    )
    settings = streampack.open(tmp_path / "c").manifest.settings
    at_default = {"chat_turns", "chat_reasoning"}  # written only where they are not the default
    assert set(settings.to_json()) | at_default == {f.name for f in dataclasses.fields(CacheSpec)}
    assert settings.text_field == "body" and settings.max_piece_chars == 100_000
    assert not set(settings.to_json()) & {f.name for f in dataclasses.fields(RunOptions)}


CHANGES = {
    "special_tokens": "parse",
    "eos": False,
    "eos_id": 7,
    "text_field": "body",
    "split_lines": True,
    "unit_bytes": 1 << 17,
    "max_piece_chars": 5_000,
    "bos": True,
    "bos_id": 7,
    "fields": ["text", "body"],
    "chat": "messages",
    "chat_turns": "last",
    "chat_reasoning": "mask",
}
# What a change of a field needs beside it: the chat policies choose a chat build's targets.
BESIDE = {"chat_turns": {"chat": "messages"}, "chat_reasoning": {"chat": "messages"}}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(CacheSpec) if f.name != "tokenizer"])
def test_resuming_with_any_other_spec_field_is_refused_by_name(
    tmp_path: Path, bpe_tokenizer: Path, field: str
) -> None:
    tokenizer = (
        tmp_path / "tok"
    )  # a tokenizer with a BOS token and a chat template, so that both can be asked
    tokenizer.mkdir()
    shutil.copy(bpe_tokenizer, tokenizer / "tokenizer.json")
    config = {
        "bos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    record = {"text": "one", "body": "uno", "messages": [{"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "a.jsonl", [record])
    beside = BESIDE.get(field, {})
    streampack.build(path, tmp_path / "c", tokenizer=str(tokenizer), **beside)
    with pytest.raises(ConfigMismatchError, match=rf"{field}: the cache has .*, this build has"):
        streampack.build(path, tmp_path / "c", tokenizer=str(tokenizer), **{**beside, field: CHANGES[field]})


def test_run_options_do_not_stop_a_resume(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}])
    streampack.build(path, tmp_path / "c", workers=1)
    summary = streampack.build(path, tmp_path / "c", workers=2, threads=1, commit_seconds=1.0, batch_chars=10)
    assert summary.num_docs == 1


def test_workers_share_the_cores_unless_threads_are_given() -> None:
    assert worker_threads(RunOptions(), workers=2, cores=2) == 1
    assert worker_threads(RunOptions(), workers=2, cores=16) == 8
    assert worker_threads(RunOptions(), workers=3, cores=2) == 1
    assert worker_threads(RunOptions(threads=4), workers=2, cores=2) == 4
