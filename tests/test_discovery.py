"""Tests for `streampack.inputs.discovery`: each real file once, symlinks and loops, hidden entries, caches,
documents that are not JSON Lines, URL folders, and an output directory mixed with its inputs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import streampack
from streampack.errors import InputError
from streampack.inputs.discovery import Ignored, check_output_outside_inputs, discover_inputs, expand_inputs
from tests.conftest import run_cli, write_jsonl


def _tree(root: Path) -> Path:
    """The A4 tree: a file, a hidden checkpoint copy, a symlink loop, and a symlinked folder elsewhere."""
    write_jsonl(root / "d" / "a.jsonl", [{"text": "x"}])
    write_jsonl(root / "d" / "sub" / "b.jsonl", [{"text": "b"}])
    write_jsonl(root / "d" / ".ipynb_checkpoints" / "a-checkpoint.jsonl", [{"text": "x"}])
    write_jsonl(root / "d" / ".hid.jsonl", [{"text": "h"}])
    (root / "d" / "sub" / "loop").symlink_to("..")
    write_jsonl(root / "elsewhere" / "e.jsonl", [{"text": "y"}])
    (root / "d" / "linkdir").symlink_to(root / "elsewhere")
    return root / "d"


def _names(paths: list[str], root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p in paths]


def test_directory_and_glob_read_each_real_file_once_through_loops_and_symlinked_folders(
    tmp_path: Path,
) -> None:
    d = _tree(tmp_path)
    expected = ["a.jsonl", "linkdir/e.jsonl", "sub/b.jsonl"]
    for spec in (d, f"{d}/**/*.jsonl", f"{d}/**"):
        found = discover_inputs([spec])
        assert _names([f.path for f in found.files], d) == expected, spec
        reasons = {os.path.relpath(i.path, d): i.reason for i in found.ignored}
        assert reasons["sub/loop"] == "symlink loop"
        assert reasons[".ipynb_checkpoints"] == reasons[".hid.jsonl"] == "hidden"


def test_loops_through_two_links_end_without_repeating_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "x" / "a.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "d" / "y" / "b.jsonl", [{"text": "b"}])
    (tmp_path / "d" / "x" / "to_y").symlink_to("../y")
    (tmp_path / "d" / "y" / "to_x").symlink_to("../x")
    for name in ("up1", "up2", "up3"):  # Python's glob walks these 3^40 ways
        (tmp_path / "d" / "y" / name).symlink_to("..")
    for spec in (tmp_path / "d", f"{tmp_path}/d/**/*.jsonl"):
        files = expand_inputs([spec])
        assert sorted(os.path.realpath(f.path) for f in files) == [
            str(tmp_path / "d" / "x" / "a.jsonl"),
            str(tmp_path / "d" / "y" / "b.jsonl"),
        ]


def test_a_file_given_twice_is_read_once_in_its_first_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _tree(tmp_path)
    monkeypatch.chdir(d)
    found = discover_inputs(["sub/b.jsonl", "a.jsonl", "./a.jsonl", str(d), "../elsewhere/e.jsonl"])
    assert _names([f.path for f in found.files], d) == ["sub/b.jsonl", "a.jsonl", "linkdir/e.jsonl"]
    duplicates = [(os.path.relpath(i.path, d), i.reason) for i in found.ignored if "duplicate" in i.reason]
    assert duplicates == [
        ("a.jsonl", f"duplicate of {d}/a.jsonl"),
        ("sub/b.jsonl", f"duplicate of {d}/sub/b.jsonl"),
        ("../elsewhere/e.jsonl", f"duplicate of {d}/linkdir/e.jsonl"),
    ]


def test_dot_dot_after_a_symlinked_folder_names_the_file_the_system_opens(tmp_path: Path) -> None:
    d = _tree(tmp_path)
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the other a"}])
    (file,) = expand_inputs([d / "linkdir" / ".." / "a.jsonl"])  # linkdir/.. is tmp_path, not d
    assert os.path.realpath(file.path) == str(tmp_path / "a.jsonl")


def test_a_hidden_file_named_explicitly_is_read(tmp_path: Path) -> None:
    d = _tree(tmp_path)
    found = discover_inputs([d / ".hid.jsonl", d])
    names = [".hid.jsonl", "a.jsonl", "linkdir/e.jsonl", "sub/b.jsonl"]
    assert _names([f.path for f in found.files], d) == names
    assert all(i.path != str(d / ".hid.jsonl") for i in found.ignored)
    assert expand_inputs([f"{d}/.*.jsonl"])[0].path == str(d / ".hid.jsonl")  # a glob naming the dot


def test_the_cli_builds_the_a4_tree_without_duplicates(tmp_path: Path) -> None:
    d = _tree(tmp_path)
    for spec in (str(d), f"{d}/**/*.jsonl"):
        out = tmp_path / f"c{len(spec)}"
        assert " 3 documents" in run_cli("build", spec, "--out", out).stdout


def test_json_documents_and_cache_files_are_not_inputs_in_directories_and_globs(tmp_path: Path) -> None:
    d = tmp_path / "g"
    write_jsonl(d / "data.json", [{"text": "one"}, {"text": "two"}])
    (d / "tokenizer.json").write_text('{\n  "model": {}\n}\n')
    (d / "list.json").write_text('[{"text": "a"}]\n')
    (d / "empty.json").write_text("")
    (d / "scalar.json").write_text('"one JSON string"\n')
    (d / "broken.json").write_text('{"text": "a broken first record\n')  # read, so that its error shows
    (d / "README.md").write_text("# data\n")
    streampack.build(d / "data.json", d / "cache")
    for spec in (d, f"{d}/**/*.json*", f"{d}/cache/ledger/*.json"):
        try:
            found = discover_inputs([spec])
        except InputError as e:  # the ledger glob: nothing but cache files
            assert "the glob matches no input files" in str(e) and "a streampack cache" in str(e)
            continue
        assert _names([f.path for f in found.files], d) == ["broken.json", "data.json", "empty.json"]
        reasons = {os.path.relpath(i.path, d): i.reason for i in found.ignored}
        assert reasons["tokenizer.json"] == reasons["list.json"] == reasons["scalar.json"] == "not JSON Lines"
        assert reasons["cache"] == "a streampack cache"
    assert {"README.md": "not an input file type"}.items() <= {
        os.path.relpath(i.path, d): i.reason for i in discover_inputs([d]).ignored
    }.items()
    with pytest.raises(InputError, match=r"manifest\.json: a file of the streampack cache"):
        expand_inputs([d / "cache" / "manifest.json"])


def test_a_folder_with_nothing_to_read_says_what_it_skipped(tmp_path: Path) -> None:
    (tmp_path / "d" / ".git").mkdir(parents=True)
    (tmp_path / "d" / "config.json").write_text('{\n  "a": 1\n}\n')
    result = run_cli("build", tmp_path / "d", "--out", tmp_path / "c", check=False)
    assert result.returncode == 1
    assert "the directory holds no input files" in result.stderr
    assert "skipped: " in result.stderr and ".git (hidden)" in result.stderr
    assert "config.json (not JSON Lines)" in result.stderr


def test_special_files_in_a_folder_are_skipped_and_listed(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "a"}])
    os.mkfifo(tmp_path / "d" / "pipe.jsonl")
    (tmp_path / "d" / "broken.jsonl").symlink_to(tmp_path / "nowhere")
    found = discover_inputs([tmp_path / "d"])
    assert [Path(f.path).name for f in found.files] == ["a.jsonl"]
    assert {Path(i.path).name: i.reason for i in found.ignored} == {
        "broken.jsonl": "not a regular file",
        "pipe.jsonl": "not a regular file",
    }


def test_a_url_folder_is_expanded_like_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write_jsonl(d / "b.jsonl", [{"text": "b"}])
    write_jsonl(d / "sub" / "a.jsonl.gz", [{"text": "a"}])
    write_jsonl(d / ".hidden" / "h.jsonl", [{"text": "h"}])
    (d / "config.json").write_text('{\n  "a": 1\n}\n')
    (d / "notes.md").write_text("notes")
    found = discover_inputs([f"file://{d}/"])
    assert [f.path for f in found.files] == [f"file://{d}/b.jsonl", f"file://{d}/sub/a.jsonl.gz"]
    assert {i.path: i.reason for i in found.ignored} == {
        f"file://{d}/.hidden": "hidden",
        f"file://{d}/config.json": "not JSON Lines",
        f"file://{d}/notes.md": "not an input file type",
    }
    assert streampack.build(f"file://{d}/", tmp_path / "c").num_docs == 2


def test_a_missing_url_says_why(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope/: cannot read \(FileNotFoundError: .*No such"):
        expand_inputs([f"file://{tmp_path}/nope/"])


# --- the output directory against the inputs (B4) --------------------------------------------------------


def test_out_equal_to_the_input_directory_is_refused_up_front(tmp_path: Path) -> None:
    e = tmp_path / "e"
    write_jsonl(e / "f.jsonl", [{"text": "a"}])
    expected = f"out={e} is the input directory {e}: the cache would be read as input"
    for extra in ((), (), ("--overwrite",)):  # the first run, a rerun and an --overwrite all say why
        result = run_cli("build", e, "--out", e, *extra, check=False)
        assert result.returncode == 1 and expected in result.stderr, result.stderr
        assert not (e / "manifest.json").exists()
    streampack.build(e / "f.jsonl", tmp_path / "old")  # a cache already there (from an older streampack)
    for name in ("manifest.json", "ledger", "shards"):
        shutil.move(tmp_path / "old" / name, e / name)
    result = run_cli("build", e, "--out", e, check=False)
    assert result.returncode == 1 and expected in result.stderr, result.stderr


def test_out_at_a_glob_root_or_holding_an_input_is_refused_but_inside_an_input_folder_is_not(
    tmp_path: Path,
) -> None:
    write_jsonl(tmp_path / "e" / "data" / "f.jsonl", [{"text": "a"}])
    e = tmp_path / "e"
    with pytest.raises(InputError, match=r"is the root of the input glob .*/e/\*\.jsonl"):
        check_output_outside_inputs(e, [f"{e}/*.jsonl"])
    with pytest.raises(InputError, match=r"holds the input .*/e/data/f\.jsonl"):
        check_output_outside_inputs(e, [e / "data" / "f.jsonl"])
    with pytest.raises(InputError, match=r"is the input file"):
        check_output_outside_inputs(e / "data" / "f.jsonl", [e / "data" / "f.jsonl"])
    check_output_outside_inputs(e / "data" / "cache", [e / "data", "https://host/e", "-"])
    for _ in range(2):
        assert streampack.build(e / "data", e / "data" / "cache").num_docs == 1


def test_discovery_reports_are_plain_values() -> None:
    assert Ignored("a", "hidden") == Ignored("a", "hidden")


def test_a_files_manifest_record_is_made_straight_from_its_stats(tmp_path: Path) -> None:
    from streampack.format.sections import InputRecord
    from streampack.inputs.local import local_file

    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n')
    found = local_file(str(path))
    assert found.stat_json() == InputRecord(found.path, found.size, found.mtime_ns).to_json()


@pytest.mark.parametrize(
    "path",
    ["/a/b.txt", "/a//b.txt", "//a/b.txt", "/a/./b.txt", "/a/../b.txt", "/a/.b.txt", "a/b.txt", "/a/b/", "/"],
)
def test_a_found_path_is_taken_as_absolute_only_where_abspath_gives_it_back(path: str) -> None:
    from streampack.inputs.local import _absolute_and_normal

    assert not _absolute_and_normal(path) or os.path.abspath(path) == path
    assert _absolute_and_normal("/a/b.txt")
