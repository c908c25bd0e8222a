"""``output="hf-flash"``: the segments of a packed batch under the names Hugging Face's flash-attention path
reads, checked against ``transformers.DataCollatorWithFlattening`` and through a real model's forward.

Flash attention itself needs a GPU here; the forward test registers a varlen attention function of its own
(scaled-dot-product attention within each ``cu_seq_lens_q`` segment) through transformers'
``AttentionInterface``, so the model's own code passes the batch's fields down to the attention, and the
logits must equal those of each document run alone.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

import streampack
import streampack.hf
import streampack.torch
from streampack.samples import PackedSequences
from tests.conftest import SAMPLE_CORPUS, write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ_LEN = 64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer: Path) -> PackedSequences:
    """Windows of real text (the sample corpus's first 300 documents, cut to their first 200 characters so
    that rows hold several; GPT-2 ids)."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"the sample corpus is absent ({SAMPLE_CORPUS})")
    root = tmp_path_factory.mktemp("flash")
    with zstandard.open(SAMPLE_CORPUS, "rt") as f:
        texts = [json.loads(line)["text"][:200] for line in itertools.islice(f, 300)]
    corpus = write_jsonl(root / "docs.jsonl", [{"text": text} for text in texts])
    streampack.build(corpus, root / "cache", tokenizer=str(gpt2_tokenizer))
    return streampack.open(root / "cache").sequences(SEQ_LEN)


def _flattened(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's segments handed to ``DataCollatorWithFlattening`` as examples, one per segment."""
    cu, ids = batch["cu_seq_lens_q"], batch["input_ids"].reshape(-1)
    features = [{"input_ids": ids[a:z].tolist()} for a, z in itertools.pairwise(cu.tolist())]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="np")
    return collator(features)


def test_the_fields_equal_what_transformers_own_flattening_collator_gives(samples: PackedSequences) -> None:
    loader = streampack.Loader(samples, batch_size=8, seed=3, output="hf-flash")
    for position in (0, 5):
        batch = loader.batch(position)
        expected = _flattened(batch)
        assert batch["cu_seq_lens_q"].dtype == expected["cu_seq_lens_q"].dtype == np.int32
        np.testing.assert_array_equal(batch["cu_seq_lens_q"], expected["cu_seq_lens_q"])
        np.testing.assert_array_equal(batch["cu_seq_lens_k"], expected["cu_seq_lens_k"])
        assert batch["max_length_q"] == batch["max_length_k"] == expected["max_length_q"]
        assert isinstance(batch["max_length_q"], int)
        np.testing.assert_array_equal(batch["position_ids"].reshape(1, -1), expected["position_ids"])
        np.testing.assert_array_equal(batch["labels"].reshape(1, -1), expected["labels"])
        assert len(batch["cu_seq_lens_q"]) > batch["input_ids"].shape[0] + 1  # rows hold several documents


def test_the_dict_fields_are_those_of_output_dict_and_varlen(samples: PackedSequences) -> None:
    flash = streampack.Loader(samples, batch_size=4, seed=1, output="hf-flash").batch(2)
    varlen = streampack.Loader(samples, batch_size=4, seed=1, output="varlen").batch(2)
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(flash[name], varlen[name])
    np.testing.assert_array_equal(flash["cu_seq_lens_q"], varlen["cu_seqlens"])
    assert flash["max_length_q"] == varlen["max_seqlen"]


def _segment_attention(calls: list[list[str]]) -> Any:
    """A varlen attention for transformers' ``AttentionInterface``: causal attention within each segment."""

    def attend(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        calls.append(sorted(kwargs))
        batch, heads, length, width = query.shape
        q, k, v = (x.transpose(1, 2).reshape(batch * length, heads, width) for x in (query, key, value))
        out = torch.empty_like(q)
        for a, z in itertools.pairwise(kwargs["cu_seq_lens_q"].tolist()):
            pieces = (x[a:z].transpose(0, 1) for x in (q, k, v))
            attended = torch.nn.functional.scaled_dot_product_attention(
                *pieces, is_causal=True, scale=kwargs.get("scaling")
            )
            out[a:z] = attended.transpose(0, 1)
        return out.reshape(batch, length, heads, width), None

    return attend


def test_a_real_model_forward_reads_them_and_attends_within_each_document(samples: PackedSequences) -> None:
    calls: list[list[str]] = []
    transformers.AttentionInterface.register("streampack-test-varlen", _segment_attention(calls))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=SEQ_LEN, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    dataloader = streampack.torch.DataLoader(
        streampack.Loader(samples, batch_size=4, seed=5, output="hf-flash"), num_workers=2
    )
    batch = next(iter(dataloader))
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and isinstance(batch["max_length_q"], int)
    model.set_attn_implementation("streampack-test-varlen")
    with torch.no_grad():
        packed = model(**batch).logits.reshape(-1, config.vocab_size)
    assert calls and {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(calls[0])
    model.set_attn_implementation("sdpa")
    ids = batch["input_ids"].reshape(-1)
    with torch.no_grad():
        for a, z in itertools.pairwise(batch["cu_seq_lens_q"].tolist()):
            alone = model(input_ids=ids[a:z][None]).logits[0]
            torch.testing.assert_close(packed[a:z], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_hf_trainer_trains_on_it(samples: PackedSequences, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    transformers.AttentionInterface.register("streampack-test-varlen", _segment_attention(calls))
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=SEQ_LEN, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("streampack-test-varlen")
    args = transformers.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    loader = streampack.Loader(samples, batch_size=4, output="hf-flash")
    trainer = streampack.hf.Trainer(model=model, args=args, train_dataset=loader)
    assert trainer.train().training_loss > 0
    assert len(calls) == 2  # one layer, two steps: the model's attention read the fields at every step
