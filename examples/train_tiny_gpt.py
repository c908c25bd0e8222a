"""Train a tiny GPT from a streampack cache on the CPU, checkpoint it, kill it, and resume it exactly.

The checkpoint holds the model, the optimizer, the torch RNG state and the data loader's state (a few
integers: seed, epoch, samples consumed). Resuming reloads all four, so the resumed run sees the very
batches the uninterrupted run would have seen, and its loss curve continues where it stopped.

Try it::

    streampack demo --out demo-cache          # or: streampack build corpus.jsonl --out demo-cache
    python examples/train_tiny_gpt.py demo-cache --out run --steps 300 &
    sleep 20; kill %1                         # or: --stop-after 120
    python examples/train_tiny_gpt.py demo-cache --out run --steps 300   # resumes from the last checkpoint

Each run appends one JSON line per step to ``OUT/log.jsonl``: the step, its loss, and a digest of its
batch, so two runs can be compared batch by batch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import streampack
from streampack.loader import Loader
from streampack.torch import DataLoader


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int
    seq_len: int
    layers: int = 2
    heads: int = 2
    dim: int = 64


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (batch, time, dim)."""
        batch, time_, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, time_, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time_, dim))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model, small enough to train on a laptop CPU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied embeddings

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` given ``ids``, both (batch, time) int64."""
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", help="a streampack cache directory")
    parser.add_argument("--out", required=True, help="checkpoint and log directory (resumes from it)")
    parser.add_argument("--steps", type=int, default=300, help="total training steps")
    parser.add_argument(
        "--stop-after", type=int, help="checkpoint and exit after this step (simulates a kill)"
    )
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="seeds both the model and the data order")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (one suits a tiny model beside its workers)"
    )
    return parser.parse_args(argv)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically: a kill during the write leaves the previous one intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def digest(batch: torch.Tensor) -> str:
    """A short fingerprint of a batch's tokens."""
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]


def train(args: argparse.Namespace) -> None:
    """Train (or resume training) until ``args.steps`` steps are done, or ``--stop-after``."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    cache = streampack.open(args.cache)
    config = GPTConfig(vocab_size=cache.vocab_size, seq_len=args.seq_len)
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = Loader(cache.sequences(args.seq_len, overlap=1), batch_size=args.batch_size, seed=args.seed)
    data = DataLoader(loader, num_workers=args.workers, persistent_workers=args.workers > 0)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    step = 0
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        data.load_state_dict(checkpoint["data"])
        torch.set_rng_state(checkpoint["rng"])
        step = checkpoint["step"]
        print(f"resumed at step {step} (data: position {loader.position}, epoch {loader.epoch})")
    last = min(args.steps, args.stop_after or args.steps)
    first, started = step, time.perf_counter()

    def checkpoint() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        save_checkpoint(checkpoint_path, state | {"data": data.state_dict(), "rng": torch.get_rng_state()})

    with open(out / "log.jsonl", "a") as log:
        # zip asks range first, so no batch is drawn (and the data state not moved) past the last step
        for step, batch in zip(range(first + 1, last + 1), data):
            for group in optimizer.param_groups:  # cosine decay, a function of the step alone
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            loss = model(batch[:, :-1], batch[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            log.write(json.dumps({"step": step, "loss": loss.item(), "batch": digest(batch)}) + "\n")
            if step % 10 == 0 or step == last:
                rate = (step - first) / (time.perf_counter() - started)
                print(f"step {step:5d}  loss {loss.item():.4f}  ({rate:.1f} steps/s)", flush=True)
            if step % args.checkpoint_every == 0 or step == last:
                log.flush()
                checkpoint()
    print(f"stopped at step {step} of {args.steps}" if step < args.steps else f"done: {step} steps")


if __name__ == "__main__":
    train(parse_args())
