"""Benchmark a reasoning and agent SFT build against a plain JSONL build of the same rendered text.

The corpus: conversations with a system prompt, tools, tool-call rounds (a call with reasoning, a tool
response) and final answers with reasoning, rendered with Qwen3's chat template
(``tests/fixtures/chat_templates/qwen3.jinja``, which drops earlier turns' reasoning: each conversation is
rendered whole and its turns found in the render). The baseline: a plain JSONL of ``{"text": render}``, the
same text, built without a chat. Each repeat builds both, in fresh processes, alternating which goes first;
the ratio is the median of the per-repeat ratios of MB/s of rendered text (chat ÷ plain).

Usage::

    python benchmarks/bench_sft.py [--quick] [--repeats N] [--conversations N]

Prints a markdown table and writes it to ``benchmarks/results/sft.md`` (``sft-quick.md`` with ``--quick``).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
from pathlib import Path

from _backends import TOKENIZERS_GPT2
from _measure import run
from _report import environment, goal, parser, publish
from tokenizers import Tokenizer

from streampack.inputs.sft import ChatTemplate

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
RATIO_GOAL = 0.8
WORDS = [
    "the",
    "a",
    "model",
    "tool",
    "call",
    "city",
    "weather",
    "sunny",
    "answer",
    "think",
    "step",
    "result",
    "value",
    "check",
    "plan",
    "so",
    "then",
]


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random) -> dict[str, object]:
    """An agent conversation: per question, tool-call rounds and an answer, each with reasoning."""
    messages: list[dict[str, object]] = [{"role": "system", "content": words(rng, 5, 20)}]
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": words(rng, 5, 40)})
        for _ in range(rng.randint(0, 2)):
            arguments = json.dumps({"city": words(rng, 1, 2)})
            call = {"type": "function", "function": {"name": "weather", "arguments": arguments}}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": words(rng, 10, 60),
                    "tool_calls": [call],
                }
            )
            messages.append({"role": "tool", "content": words(rng, 5, 30)})
        messages.append(
            {"role": "assistant", "content": words(rng, 10, 80), "reasoning_content": words(rng, 20, 120)}
        )
    tool = {
        "name": "weather",
        "description": "The weather",
        "parameters": {"type": "object", "properties": {}},
    }
    return {"messages": messages, "tools": [{"type": "function", "function": tool}]}


def write_inputs(tmp: Path, count: int) -> tuple[Path, Path, Path, int]:
    """The tokenizer folder, the chat JSONL, the plain JSONL of the same renders, and their size."""
    folder = tmp / "tok"
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(TOKENIZERS_GPT2))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    template = ChatTemplate("messages", TEMPLATE.read_text(), str(TEMPLATE))
    rng = random.Random(0)
    records = [conversation(rng) for _ in range(count)]
    chats, plain = tmp / "chats.jsonl", tmp / "plain.jsonl"
    size = 0
    with open(chats, "w") as c, open(plain, "w") as p:
        for record in records:
            text = template.render(record["messages"], tools=record["tools"])  # type: ignore[arg-type]
            size += len(text.encode())
            c.write(json.dumps(record) + "\n")
            p.write(json.dumps({"text": text}) + "\n")
    return folder, chats, plain, size


def build_seconds(inputs: Path, out: Path, tokenizer: Path, *chat: str) -> float:
    cmd = [sys.executable, "-m", "streampack", "build", str(inputs), "--out", str(out), "--overwrite"]
    m = run(
        [*cmd, "--tokenizer", str(tokenizer), "--tokenizer-engine", "tokenizers", "--workers", "1", *chat]
    )
    if m.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{m.stderr[-3000:]}")
    return m.wall_s


def main() -> None:
    args_parser = parser(__doc__ or "", "sft", repeats=5, batches=0)
    args_parser.add_argument("--conversations", type=int, default=20_000)
    args = args_parser.parse_args()
    count = 1_000 if args.quick else args.conversations
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    folder, chats, plain, size = write_inputs(tmp, count)
    mb = size / 1e6
    rows: dict[str, list[float]] = {"chat": [], "plain": []}
    ratios = []
    for repeat in range(args.repeats):
        order = ["chat", "plain"] if repeat % 2 == 0 else ["plain", "chat"]
        seconds = {}
        for name in order:
            chat = ("--chat", "messages", "--chat-reasoning", "mask") if name == "chat" else ()
            seconds[name] = build_seconds(chats if name == "chat" else plain, tmp / name, folder, *chat)
            rows[name].append(mb / seconds[name])
        ratios.append(seconds["plain"] / seconds["chat"])
        print(f"[bench_sft] repeat {repeat}: {seconds}", file=sys.stderr, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median(ratios)
    report = "\n".join(
        [
            "# SFT build: reasoning and agent chats vs plain JSONL of the same text",
            "",
            environment(),
            "",
            f"{count} conversations, {mb:.1f} MB rendered (Qwen3 template, tools, tool calls, reasoning "
            f"masked); GPT-2 tokenizer.json, --tokenizer-engine tokenizers, 1 worker; {args.repeats} paired "
            "repeats, alternating order. Shared machine: ratios are fair, absolute figures are not.",
            "",
            "| build | MB/s (median) |",
            "|---|---|",
            f"| plain JSONL of the renders (baseline) | {statistics.median(rows['plain']):.2f} |",
            f"| --chat messages | {statistics.median(rows['chat']):.2f} |",
            "",
            f"Ratio chat ÷ plain (median of paired repeats): {ratio:.2f} "
            f"(each: {', '.join(f'{r:.2f}' for r in ratios)})",
            "",
            "Goals:",
            goal("reasoning-SFT build ÷ plain JSONL build of the same text", ratio, ">=", RATIO_GOAL),
            "",
        ]
    )
    publish(report, "sft", args)


if __name__ == "__main__":
    main()
