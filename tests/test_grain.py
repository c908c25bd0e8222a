"""Tests for `streampack.grain` and `streampack.jax`: grain's source protocol, its packers, global arrays."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import streampack
from streampack.errors import CacheError
from streampack.grain import DocumentSource, SequenceSource
from tests.frameworks import NUM_SAMPLES, numbered_cache, sample_ids


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> streampack.Cache:
    return numbered_cache(tmp_path_factory.mktemp("grain") / "c")


def test_sources_answer_as_grain_calls_them(cache: streampack.Cache) -> None:
    # grain asks len(), then items by SupportsIndex keys in [0, len) from a thread pool, in workers that
    # received the source pickled, and keys checkpoints by repr().
    seqs = SequenceSource(cache.sequences(8), dtype=np.int32)
    docs = DocumentSource(cache)
    assert len(seqs) == NUM_SAMPLES and len(docs) == cache.num_docs
    assert seqs[np.int64(7)].tolist() == [7] * 8 and seqs[7].dtype == np.int32
    assert docs[5].tolist() == cache.doc(5).tolist() and docs[5].flags.writeable
    for source in (seqs, docs):
        copy = pickle.loads(pickle.dumps(source))
        assert repr(copy) == repr(source)
        with ThreadPoolExecutor(8) as pool:
            items = list(pool.map(copy.__getitem__, range(len(copy))))
        assert all(np.array_equal(a, source[i]) for i, a in enumerate(items))
    with pytest.raises(IndexError):
        docs[len(docs)]
    with pytest.raises(TypeError):
        docs[1.5]  # type: ignore[index]


def test_a_document_source_refuses_a_cache_that_changed_since(
    cache: streampack.Cache, tmp_path: Path
) -> None:
    import shutil

    from streampack.testing.caches import write_cache

    root = tmp_path / "c"
    shutil.copytree(cache.root, root)
    source = pickle.dumps(DocumentSource(streampack.open(root)))
    shutil.rmtree(root)
    tokens = np.arange(1200) % 1000
    write_cache(root, [(tokens, np.arange(2, 1201, 2))], vocab_size=1000, eos_id=999)  # other documents
    with pytest.raises(
        CacheError, match=r"changed on disk since this document source .* now holds 600 documents"
    ):
        pickle.loads(source)[0]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("grain") is None, reason="needs pip install 'streampack[grain]'")
def test_grain_packs_the_documents_and_resumes_from_its_own_state(cache: streampack.Cache) -> None:
    import grain

    source = DocumentSource(cache, dtype=np.int32)
    assert isinstance(source, grain.sources.RandomAccessDataSource)

    def pipeline() -> grain.IterDataset:
        docs = grain.MapDataset.source(source).shuffle(seed=4).map(lambda tokens: {"tokens": tokens})
        return grain.experimental.FirstFitPackIterDataset(
            docs.to_iter_dataset(), length_struct={"tokens": 8}, num_packing_bins=4
        ).batch(2)

    iterator = iter(pipeline())
    head = [next(iterator) for _ in range(5)]
    state = iterator.get_state()
    tail = [next(iterator) for _ in range(5)]
    resumed = iter(pipeline())
    resumed.set_state(state)
    again = [next(resumed) for _ in range(5)]
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(tail, again, strict=True))
    # Packed whole: each segment of a bin is one document of the cache, none more often than it is there.
    documents = Counter(tuple(cache.doc(i).tolist()) for i in range(cache.num_docs))
    segments = [
        tuple(tokens[ids == segment].tolist())
        for batch in head + tail
        for tokens, ids in zip(batch["tokens"], batch["tokens_segment_ids"], strict=True)
        for segment in set(ids.tolist()) - {0}
    ]
    assert len(segments) >= 20 and not Counter(segments) - documents


_JAX_SCRIPT = """
import json, sys
import jax, numpy as np
import streampack, streampack.jax

mesh = jax.make_mesh((jax.device_count(),), ("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
seqs = streampack.open(sys.argv[1]).sequences(8)

def loader():
    return streampack.Loader(seqs, batch_size=8, seed=6, rank=jax.process_index(),
                             world_size=jax.process_count(), output="dict")

first = loader()
batches = streampack.jax.global_batches(first, sharding)
head = [next(batches) for _ in range(2)]
state = first.state_dict()
batches.close()
resumed = loader()
resumed.load_state_dict(state)
tail = [batch for _, batch in zip(range(2), streampack.jax.global_batches(resumed, sharding))]
batch = head[0]["input_ids"]
print(json.dumps({
    "devices": jax.device_count(),
    "shape": list(batch.shape),
    "shards": [list(shard.data.shape) for shard in batch.addressable_shards],
    "ids": [np.asarray(b["input_ids"])[:, 0].tolist() for b in head + tail],
    "labels_masked": bool((np.asarray(head[0]["labels"]) == -100).any()),
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs pip install 'streampack[jax]'")
def test_jax_global_batches_are_the_loaders_and_resume_exactly(
    cache: streampack.Cache, tmp_path: Path
) -> None:
    script = tmp_path / "jax_batches.py"
    script.write_text(textwrap.dedent(_JAX_SCRIPT))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, str(script), str(cache.root)], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["devices"] == 4 and got["shape"] == [8, 8] and got["shards"] == [[2, 8]] * 4
    reference = streampack.Loader(cache.sequences(8), batch_size=8, seed=6)
    assert got["ids"] == [sample_ids(reference.batch(8 * step)) for step in range(4)]
    assert got["labels_masked"]
