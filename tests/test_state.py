"""A loader state is read strictly: every kind of state, every way to get a key wrong, refused by name.

The table is made from the state format itself (``streampack.loader.state``): a key added there is tried here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import streampack
from streampack import BlockShuffle, Follow, Loader, Mixture
from streampack.errors import LoaderStateError
from streampack.loader.state import LOADER_VERSIONS, ORDERS, HistoryEntry, MixtureSource
from tests.conftest import write_jsonl

Path_ = tuple[str | int, ...]  # where a part is: () the state, ("order",), ("history", 0), ...


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("state")
    made = []
    for name in ("web", "code"):
        docs = [{"text": f"{name} document {i} " * (i % 5 + 2)} for i in range(150)]
        streampack.build([write_jsonl(root / f"{name}.jsonl", docs)], root / name, tokenizer="bytes")
        made.append(root / name)
    return made[0], made[1]


def loaders(caches: tuple[Path, Path]) -> dict[str, Callable[[], Loader]]:
    """A loader making each kind of state (each kind of order, and version 1), anew at every call."""
    web, code = (streampack.open(path).sequences(16) for path in caches)
    return {
        "shuffled": lambda: Loader(web, batch_size=4, seed=3),
        "blocks": lambda: Loader(web, batch_size=4, seed=3, shuffle=BlockShuffle(block=8, window=2)),
        "mixture": lambda: Loader(
            Mixture({"web": web, "code": code}, {"web": 3, "code": 1}, block_size=8), batch_size=4
        ),
        "follow": lambda: Follow(caches[0], seq_len=16, batch_size=4, seed=3, first_era=8, largest_era=32),
        "version 1": lambda: Loader(web, batch_size=4, seed=3),
    }


def saved_state(kind: str, loader: Loader) -> dict[str, Any]:
    """A real state of ``kind``, after two batches, as a checkpoint file holds it."""
    loader.advance(2)
    if kind == "version 1":  # as streampack before mixtures wrote it
        size = len(loader.sources[0])
        return {
            "format": "streampack.Loader", "version": 1, "seed": 3, "shuffle": True, "batch_size": 4,
            "drop_last": True, "dataset": loader.sources[0].fingerprint, "epoch": loader.position // size,
            "samples_in_epoch": loader.position % size, "world_size": 1,
        }  # fmt: skip
    return json.loads(json.dumps(loader.state_dict()))


Schema = type[msgspec.Struct]


def parts(kind: str) -> list[tuple[Path_, Schema, int]]:
    """Each part of a state of ``kind`` with its struct, and the version named in its messages."""
    if kind == "version 1":
        return [((), LOADER_VERSIONS[1], 1)]
    found = [((), LOADER_VERSIONS[2], 2), (("order",), ORDERS[kind], 2), (("history", 0), HistoryEntry, 2)]
    if kind == "mixture":
        found += [(("order", "sources", name), MixtureSource, 2) for name in ("web", "code")]
    return found


def required(schema: Schema) -> list[str]:
    return [field.name for field in msgspec.structs.fields(schema) if field.required]


def keys(schema: Schema) -> list[str]:
    return [field.name for field in msgspec.structs.fields(schema)]


# Values of the wrong type for what a key holds: every key gets "x" and None, and a near miss.
NEAR_MISSES: dict[type, list[object]] = {int: [True, -1, 1.5], bool: [1], dict: [[]], list: [{}]}
# Keys of a history entry that may be null (a step not known, an order that is no mixture), and the
# exclusions, whose shape the exclusions define.
NULLABLE = {"step", "block_size", "schedule"}
ANY_VALUE = {"exclusions"}


def mistakes(kind: str) -> list[tuple[str, Path_, str, Callable[[dict], None]]]:
    """(what, part, the key the message must name, how to make the mistake in a state's part)."""
    made: list[tuple[str, Path_, str, Callable[[dict], None]]] = []
    for path, schema, _ in parts(kind):
        made.append(("unknown key", path, "surprise", lambda part: part.update(surprise=1)))
        for key in required(schema):
            if key not in ("format", "version", "kind"):  # those decide which schema applies: see below
                made.append(("missing key", path, key, lambda part, key=key: part.pop(key)))
        for key in keys(schema):
            if key in ("format", "version") or (key == "kind" and path != ("history", 0)):
                continue
            if schema is HistoryEntry and key in ANY_VALUE:
                continue
            nullable = schema is HistoryEntry and key in NULLABLE
            near = NEAR_MISSES.get(_kind_of(kind, path, key), [])
            if schema is HistoryEntry and key == "kind":  # any kind's name, so a string
                near = [1]
            for wrong in [*([] if key == "kind" else ["x"]), *([] if nullable else [None]), *near]:
                made.append((f"wrong type {wrong!r}", path, key, _setter(key, wrong)))
    other_version = ["position"] if kind == "version 1" else ["epoch", "samples_in_epoch"]
    add = {"position": 8} if kind == "version 1" else {"epoch": 0, "samples_in_epoch": 8}
    made.append(("keys of the other version", (), other_version[0], lambda part: part.update(add)))
    return made


def _setter(key: str, wrong: object) -> Callable[[dict], None]:
    return lambda part: part.update({key: wrong})


def _kind_of(kind: str, path: Path_, key: str) -> type:
    """The type of the value the key holds in a real state of ``kind`` (for its near misses)."""
    if path[:1] == ("history",):
        return {"position": int, "step": int, "order": str, "kind": str, "seed": int, "shuffle": bool,
                "batch_size": int, "world_size": int, "batches_per_step": int, "data": dict,
                "block_size": int, "schedule": list, "served": dict, "epochs": int, "stop": str,
                "drop_last": bool, "sources": list, "balance": str, "cp_size": int,
                "loss_weights": dict}[key]  # fmt: skip
    return {"seed": int, "position": int, "batch_size": int, "world_size": int, "epoch": int,
            "samples_in_epoch": int, "block": int, "window": int, "block_size": int, "shuffle": bool,
            "drop_last": bool, "data": dict, "dataset": dict, "order": dict, "sources": dict,
            "schedule": list, "eras": list, "exclusions": list, "history": list, "history_digest": str,
            }[key]  # fmt: skip


KINDS = ["shuffled", "blocks", "mixture", "follow", "version 1"]
CASES = [(kind, *mistake) for kind in KINDS for mistake in mistakes(kind)]


def part_of(state: dict, path: Path_) -> dict:
    part: Any = state
    for key in path:
        part = part[key]
    return part


@pytest.mark.parametrize(
    ("kind", "what", "path", "key", "mistake"),
    CASES,
    ids=[f"{kind}-{'.'.join(map(str, path)) or 'state'}-{key}-{what}" for kind, what, path, key, _ in CASES],
)
def test_every_kind_of_state_refuses_every_wrong_key_naming_it_and_the_version(
    caches: tuple[Path, Path], kind: str, what: str, path: Path_, key: str, mistake: Callable[[dict], None]
) -> None:
    make = loaders(caches)[kind]
    state = saved_state(kind, make())
    wrong = copy.deepcopy(state)
    mistake(part_of(wrong, path))
    loader = make()
    loader.advance(1)
    before = loader.position, loader.order.fingerprint()
    with pytest.raises(LoaderStateError) as info:
        loader.load_state_dict(wrong)
    message = str(info.value)
    version = 1 if kind == "version 1" else 2
    assert any(named in message for named in (f"`{key}`", f".{key}`", repr(key))), message
    assert f"version {version}" in message, message
    assert (loader.position, loader.order.fingerprint()) == before  # a refused state changes nothing
    loader.load_state_dict(state)  # the state as it was saved resumes
    assert loader.position == 8


def test_a_version_2_state_with_version_1_keys_says_how_version_2_says_it(caches: tuple[Path, Path]) -> None:
    """The issue's case: a script that edits a checkpoint writes version 1's keys into a version 2 state,
    which used to resume silently at its own position."""
    loader = loaders(caches)["shuffled"]()
    state = saved_state("shuffled", loader) | {"epoch": 3, "samples_in_epoch": 0}
    with pytest.raises(LoaderStateError) as info:
        loaders(caches)["shuffled"]().load_state_dict(state)
    message = str(info.value)
    assert message.startswith("version 2 loader state: Object contains unknown field `epoch` - at `$`; ")
    assert "sample s of epoch e of a dataset of N samples is position e * N + s" in message
    assert "leave out 'epoch' and 'samples_in_epoch', which are version 1's keys" in message


def test_a_real_version_1_state_still_resumes_where_it_stood(caches: tuple[Path, Path]) -> None:
    make = loaders(caches)["version 1"]
    reference = make()
    state = saved_state("version 1", reference)
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.position == reference.position == 8
    assert np.array_equal(resumed.batch(8), reference.batch(8))


def test_every_order_refuses_the_kinds_it_does_not_resume(caches: tuple[Path, Path]) -> None:
    """Only the kinds an order resumes are read by their schema first: any other kind is refused by the
    order itself, naming it, so no kind reaches an order unread."""
    make = loaders(caches)
    states = {kind: saved_state(kind, make[kind]()) for kind in ORDERS}
    for kind in ORDERS:
        loader = make[kind]()
        assert set(loader.order.resumes) <= set(ORDERS)
        for other, state in states.items():
            if other in loader.order.resumes:
                continue
            with pytest.raises(LoaderStateError):
                loader.load_state_dict(state)


def test_what_each_order_saves_is_what_its_schema_holds(caches: tuple[Path, Path]) -> None:
    for kind, make in loaders(caches).items():
        if kind == "version 1":
            continue
        state = saved_state(kind, make())
        for path, schema, _ in parts(kind):
            part = part_of(state, path)
            assert set(required(schema)) <= set(part) <= set(keys(schema)), (kind, path)


# --- the adapters read the same states, through the loader ------------------------------------------


def edited(caches: tuple[Path, Path]) -> dict[str, Any]:
    return saved_state("shuffled", loaders(caches)["shuffled"]()) | {"epoch": 3, "samples_in_epoch": 0}


def test_torch_and_lightning_refuse_an_edited_state(caches: tuple[Path, Path]) -> None:
    pytest.importorskip("torch")
    import streampack.torch

    with pytest.raises(LoaderStateError, match="unknown field `epoch`"):
        streampack.torch.DataLoader(loaders(caches)["shuffled"]()).load_state_dict(edited(caches))
    pytest.importorskip("lightning")
    import streampack.lightning

    module = streampack.lightning.DataModule(loaders(caches)["shuffled"]())
    with pytest.raises(LoaderStateError, match="unknown field `epoch`"):
        module.load_state_dict(edited(caches))
    module.train_dataloader()
    with pytest.raises(LoaderStateError, match="unknown field `epoch`"):
        module.load_state_dict(edited(caches))


def test_torchdata_refuses_an_edited_sampler_state(caches: tuple[Path, Path]) -> None:
    pytest.importorskip("torchdata")
    from streampack.torchdata import LoaderBatches, LoaderSampler

    with pytest.raises(LoaderStateError, match="unknown field `epoch`"):
        LoaderSampler(loaders(caches)["shuffled"]()).load_state_dict(edited(caches))
    state = edited(caches)
    del state["epoch"], state["samples_in_epoch"]
    state["position"] = "8"
    with pytest.raises(LoaderStateError, match=r"Expected `int`, got `str` - at `\$\.position`"):
        LoaderBatches(loaders(caches)["shuffled"]())[state]


def test_hf_refuses_an_edited_checkpoint(caches: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    import streampack.hf
    from tests.frameworks import tiny_gpt2

    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / streampack.hf.LOADER_STATE_NAME).write_text(json.dumps(edited(caches)))
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=6, use_cpu=True, report_to=[]
    )
    loader = Loader(streampack.open(caches[0]).sequences(16), batch_size=4, seed=3, output="dict")
    trainer = streampack.hf.Trainer(model=tiny_gpt2(), args=args, train_dataset=loader)
    with pytest.raises(LoaderStateError, match="unknown field `epoch`"):
        trainer.train(resume_from_checkpoint=str(folder))


# --- the history: in order, and as it was saved -------------------------------------------------------------


def test_a_history_edited_or_out_of_place_is_refused_naming_the_entry(caches: tuple[Path, Path]) -> None:
    """The review's edits of a run's history (resumed at step 20 from a data state of step 10, so its audit
    is not clean): each used to load and audit clean. An entry past the state's position, or before the
    entry ahead of it, is refused by name; a deletion or a changed step by the history's digest. A state
    saved before the digest (none) still loads; the audit reads states the same way."""
    from streampack.runs.audit import audit

    web = streampack.open(caches[0]).sequences(16)
    run = Loader(web, batch_size=4, seed=3)
    run.advance(10)
    older = run.state_dict()
    resumed = Loader(web, batch_size=4, seed=3)
    resumed.load_state_dict(older, step=20)
    resumed.advance(5)
    state = json.loads(json.dumps(resumed.state_dict()))
    assert not audit(state, web).clean

    def edited(edit: Callable[[dict], None], *, digest: bool = True) -> dict[str, Any]:
        wrong = copy.deepcopy(state)
        edit(wrong)
        if not digest:
            wrong.pop("history_digest", None)
        return wrong

    cases = [
        (edited(lambda s: s["history"].pop(1)), "does not match its history_digest"),
        (edited(lambda s: s["history"][1].update(step=10)), "does not match its history_digest"),
        (edited(lambda s: s["history"][1].update(position=10**6), digest=False), r"history\[1\] begins at "
         r"position 1,000,000, past the state's own position 60"),
        (edited(lambda s: s["history"].insert(1, s["history"][1] | {"position": 50}), digest=False),
         r"history\[2\] begins at position 40, before history\[1\] \(50\)"),
    ]  # fmt: skip
    for wrong, message in cases:
        with pytest.raises(LoaderStateError, match=message):
            Loader(web, batch_size=4, seed=3).load_state_dict(wrong)
        with pytest.raises(LoaderStateError, match=message):
            audit(wrong, web)
    old = edited(lambda s: None, digest=False)  # as a streampack before the digest saved it
    Loader(web, batch_size=4, seed=3).load_state_dict(old)
    assert not audit(old, web).clean
