"""What the training-framework tests share: a cache whose batches name their samples, and tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import streampack
from streampack.testing.caches import write_cache

SEQ_LEN = 8
NUM_SAMPLES = 150
DOC_LEN = 3  # documents of 3 tokens, so output="dict" labels have -100s inside every row
VOCAB = 1000


def numbered_cache(root: Path) -> streampack.Cache:
    """A cache whose sample i is SEQ_LEN copies of the token i: a batch's first column names its samples."""
    tokens = np.repeat(np.arange(NUM_SAMPLES), SEQ_LEN)
    ends = np.append(np.arange(DOC_LEN, len(tokens), DOC_LEN), len(tokens))
    return streampack.open(write_cache(root, [(tokens, ends)], vocab_size=VOCAB, eos_id=VOCAB - 1))


def sample_ids(batch: object) -> list[int]:
    """The sample numbers of a batch (an array or tensor, or a dict holding ``input_ids``)."""
    tokens = batch["input_ids"] if isinstance(batch, dict) else batch
    assert bool((tokens == tokens[:, :1]).all()), "a row mixes samples"
    return [int(i) for i in tokens[:, 0].tolist()]


def tiny_gpt2(seed: int = 0) -> object:
    """A randomly initialised one-layer GPT-2 for the numbered cache (nothing is downloaded)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)
