"""Tests for mixture configs (`streampack.runs.mixconfig`) and the `streampack mix` command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import streampack
from streampack.errors import OptionsError
from streampack.loader import Loader
from streampack.order.mixture import Mixture
from streampack.testing.caches import write_random_cache
from tests.conftest import run_cli, s3_options, write_jsonl

YAML = """\
seq_len: 64
overlap: 1
seed: 3
block_size: 10
sources:
  web: caches/web
  code: caches/code
stages:
  - at: 0
    weights: {web: 0.8, code: 0.2}
  - at: {tokens: 6400}   # 100 samples of 64 tokens: from block 10
    weights: {web: 0.5, code: 0.5}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    write_random_cache(root / "caches" / "web", 40_000, seed=1)
    write_random_cache(root / "caches" / "code", 9_000, seed=2)
    (root / "mix.yaml").write_text(YAML)
    return root


def python_mixture(root: Path) -> Mixture:
    seqs = {
        name: streampack.open(root / "caches" / name).sequences(64, overlap=1) for name in ("web", "code")
    }
    stages = [(0, {"web": 0.8, "code": 0.2}), (100, {"web": 0.5, "code": 0.5})]
    return Mixture(seqs, stages=stages, seed=3, block_size=10)


def test_yaml_and_json_configs_give_the_mixture_python_gives(project: Path) -> None:
    expected = python_mixture(project)
    positions = np.arange(400, dtype=np.int64)
    from_yaml = streampack.load_mixture(project / "mix.yaml")
    json_config = {
        "seq_len": 64, "overlap": 1, "seed": 3, "block_size": 10,
        "sources": {"web": "caches/web", "code": "caches/code"},
        "stages": [
            {"at": 0, "weights": {"web": 0.8, "code": 0.2}}, {"at": "100", "weights": {"web": 1, "code": 1}},
        ],
    }  # fmt: skip
    (project / "mix.json").write_text(json.dumps(json_config))
    from_json = streampack.load_mixture(project / "mix.json")
    for mixture in (from_yaml, from_json):
        assert mixture.fingerprint() == expected.fingerprint()
        assert all(np.array_equal(a, b) for a, b in zip(mixture(positions), expected(positions), strict=True))
    one_stage = streampack.load_mixture(
        {"seq_len": 64, "sources": {"web": str(project / "caches/web")}, "weights": {"web": 1}}
    )
    assert one_stage.names == ("web",) and one_stage.weights(0) == [1.0]


@pytest.mark.parametrize("layout", ["packed", "documents"])
def test_a_config_may_ask_for_whole_documents(project: Path, layout: str) -> None:
    config = {"seq_len": 64, "layout": layout, "seed": 3, "weights": {"web": 1, "code": 1}}
    config["sources"] = {"web": str(project / "caches/web"), "code": str(project / "caches/code")}
    mixture = streampack.load_mixture(config)
    expected = {
        name: getattr(streampack.open(project / "caches" / name), layout)(64) for name in ("web", "code")
    }
    assert [source.fingerprint() for source in mixture.sources.values()] == [
        expected[name].fingerprint() for name in ("web", "code")
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace("stages:", "stagess:"),
            r"mix.yaml: Object contains unknown field `stagess` - at `\$`",
        ),
        (lambda t: t.replace("seq_len: 64\n", ""), "mix.yaml: Object missing required field `seq_len`"),
        (
            lambda t: t.replace("seq_len: 64", "seq_len: 6.5"),
            r"mix.yaml: Expected `int`, got `float` - at `\$.seq_len`",
        ),
        (
            lambda t: t.replace("{tokens: 6400}", "{steps: 3}"),
            r"mix.yaml: Object contains unknown field `steps` - at `\$.stages\[1\].at`",
        ),
        (lambda t: t.replace("web: 0.5,", "wbe: 0.5,"), r"mix.yaml: weights name sources .* \['wbe'\]"),
        (lambda t: t.replace("  - at: 0\n", "  - at: 0\n   bad: [\n"), "mix.yaml: not valid YAML"),
        (lambda t: t.replace("caches/code", "caches/nothing"), "caches/nothing"),
        (
            lambda t: t.replace("seed: 3", "layout: bins"),
            r"mix.yaml: Invalid enum value 'bins' - at `\$.layout`",
        ),
        (
            lambda t: t.replace("seed: 3", "layout: packed"),
            "mix.yaml: overlap applies to layout: windows only",
        ),
    ],
)
def test_config_errors_name_the_file_and_the_key(project: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    bad = project / "bad" / "mix.yaml"
    bad.parent.mkdir(exist_ok=True)
    (project / "bad" / "caches").mkdir(exist_ok=True)
    for name in ("web", "code"):
        link = project / "bad" / "caches" / name
        if not link.exists():
            link.symlink_to(project / "caches" / name)
    bad.write_text(edit(YAML))
    with pytest.raises(streampack.StreampackError, match=message):
        streampack.load_mixture(bad)
    with pytest.raises(OptionsError, match=r"a \.yaml, \.yml or \.json file"):
        streampack.load_mixture(project / "mix.toml")


@pytest.mark.slow
def test_cli_mix_prints_the_plan_and_where_a_checkpoint_stands(project: Path) -> None:
    out = run_cli("mix", "--config", project / "mix.yaml", "--steps", "25", "--batch-size", "8").stdout
    assert "position    200 samples (12,800 tokens)" in out
    assert (
        "from        position 0: web 0.8, code 0.2" in out
        and "from        position 100: web 0.5, code 0.5" in out
    )
    expected = Loader(python_mixture(project), batch_size=8).realised(25)
    for progress in expected:
        assert f"{progress.name:<16} {progress.weight:>8.4f} {progress.served:>14,}" in out
    assert expected[0].served == 80 + 50 and expected[1].served == 20 + 50  # 10 blocks of 8/2, 10 of 5/5

    loader = Loader(python_mixture(project), batch_size=8)
    loader.advance(30)
    (project / "state.json").write_text(json.dumps(loader.state_dict()))
    got = json.loads(
        run_cli("mix", "--config", project / "mix.yaml", "--state", project / "state.json", "--json").stdout
    )
    assert got["position"] == 240 and [s["served"] for s in got["sources"]] == loader.order.consumed(240)

    usage = run_cli("mix", "--config", project / "mix.yaml", "--steps", "3", check=False)
    assert usage.returncode == 2 and "--steps needs --batch-size" in usage.stderr
    broken = run_cli("mix", "--config", project / "nope.yaml", check=False)
    assert broken.returncode == 1 and "cannot read the mixture config" in broken.stderr


def test_cli_mix_far_ahead_reports_the_position_its_shares_are_of(project: Path) -> None:
    """Steps past the last position a run can reach: the position shown is the one served is counted at."""
    out = run_cli(
        "mix", "--config", project / "mix.yaml", "--steps", str(2**61), "--batch-size", "8", "--json"
    ).stdout
    report = json.loads(out)
    assert report["position"] == sum(row["served"] for row in report["sources"])


REMOTE_YAML = """\
seq_len: 16
seed: 4
block_size: 10
local_dir: copies          # relative to this file: one folder per source below it
storage_options: {{client_kwargs: {{endpoint_url: "{endpoint}"}}}}
sources:
  web: s3://{bucket}/web   # joined to nothing: read through a local copy
  code:
    path: s3://{bucket}/code
    local_dir: code-copy
    max_local_bytes: 1.0e+7
  local: caches/local      # a relative path is still relative to this file
weights: {{web: 5, code: 3, local: 2}}
"""


@pytest.fixture
def remote_project(tmp_path: Path, bucket: tuple[Any, str], s3_endpoint: str) -> tuple[Path, Path]:
    """A mixture config naming two caches in a real S3 bucket (moto on 127.0.0.1) and a local one, and
    the same config over local builds of all three."""
    _, name = bucket
    texts = {
        "web": [f"web page {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(300)],
        "code": [f"def f{i}():\n    return {i}\n" for i in range(200)],
        "local": [f"note {i} " * 5 for i in range(100)],
    }
    for source, docs in texts.items():
        write_jsonl(tmp_path / "in" / f"{source}.jsonl", [{"text": t} for t in docs])
        streampack.build([tmp_path / "in" / f"{source}.jsonl"], tmp_path / "caches" / source)
        if source != "local":
            streampack.build(
                [tmp_path / "in" / f"{source}.jsonl"],
                f"s3://{name}/{source}",
                staging_dir=str(tmp_path / "stage" / source),
                storage_options=s3_options(s3_endpoint),
            )
    (tmp_path / "mix.yaml").write_text(REMOTE_YAML.format(endpoint=s3_endpoint, bucket=name))
    local = {"web": "caches/web", "code": "caches/code", "local": "caches/local"}
    config = {"seq_len": 16, "seed": 4, "block_size": 10, "sources": local}
    (tmp_path / "local.json").write_text(json.dumps({**config, "weights": {"web": 5, "code": 3, "local": 2}}))
    return tmp_path / "mix.yaml", tmp_path / "local.json"


@pytest.mark.slow
def test_a_config_reads_caches_in_object_storage_with_their_reading_options(
    remote_project: tuple[Path, Path],
) -> None:
    remote_path, local_path = remote_project
    root = remote_path.parent
    remote, local = streampack.load_mixture(remote_path), streampack.load_mixture(local_path)
    assert remote.fingerprint() == local.fingerprint()
    positions = np.arange(300, dtype=np.int64)
    assert all(np.array_equal(a, b) for a, b in zip(remote(positions), local(positions), strict=True))
    loader, expected = Loader(remote, batch_size=10), Loader(local, batch_size=10)
    assert all(np.array_equal(loader.batch(p), expected.batch(p)) for p in range(0, 100, 10))
    stores = {name: seqs.cache.store for name, seqs in remote.sources.items()}
    assert stores["web"].root == (root / "copies" / "web").absolute()  # the config's folder, per source
    assert stores["code"].root == (root / "code-copy").absolute()  # its own
    assert any((root / "copies" / "web" / "shards").iterdir())

    out = run_cli("mix", "--config", remote_path, "--steps", "7", "--batch-size", "10", "--json").stdout
    cli_report = json.loads(out)["sources"]
    assert [row["served"] for row in cli_report] == [p.served for p in expected.realised(7)]


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (
            "{a: {path: caches/local, local_dir: x}}",
            r"local_dir apply to caches in object storage .* - at `\$.sources.a`",
        ),
        ("{a: {paht: s3://b/c}}", r"unknown field `paht` - at `\$.sources.a`"),
        ("{a: {local_dir: x}}", r"missing required field `path` - at `\$.sources.a`"),
        (
            "{a: s3://b/c}\nmax_local_bytes: lots",
            r"Expected `int \| null`, got `str` - at `\$.max_local_bytes`",
        ),
        (
            "{a: s3://b/c}\nstorage_options: [1]",
            r"Expected `object \| null`, got `array` - at `\$.storage_options`",
        ),
    ],
)
def test_reading_options_are_checked_naming_the_key(tmp_path: Path, sources: str, message: str) -> None:
    write_random_cache(tmp_path / "caches" / "local", 1000, seed=1)
    (tmp_path / "mix.yaml").write_text(f"seq_len: 8\nweights: {{a: 1}}\nsources: {sources}\n")
    with pytest.raises(OptionsError, match=message):
        streampack.load_mixture(tmp_path / "mix.yaml")


def test_cli_mix_help_names_every_key_of_a_config(project: Path) -> None:
    from streampack.runs.mixconfig import CONFIG_KEYS

    shown = run_cli("mix", "--help").stdout
    assert all(key in shown for key in CONFIG_KEYS) and "path" in shown and "s3://" in shown
    # They are the keys load_mixture takes: none is refused as unknown (a value of the wrong type is
    # refused as that), and a key not among them is.
    base = {"seq_len": 64, "sources": {"web": str(project / "caches" / "web")}}
    for key in CONFIG_KEYS:
        try:
            streampack.load_mixture({**base, key: [None]})
        except OptionsError as error:
            assert "unknown field" not in str(error), key
    with pytest.raises(OptionsError, match="unknown field `weigths`"):
        streampack.load_mixture({**base, "weigths": {"web": 1}})
