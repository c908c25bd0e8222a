"""Every Python example of the README and docs/ (the docs site's pages, guides included) runs, as written,
on small real caches.

The examples of one file run in order in one interpreter (a later example may use an earlier one's
names, as a reader would), in a folder holding what they name: ``cache/``, ``sft-cache/``, ``tok/``,
``chat-tok/`` (GPT-2 and the ChatML template of ``docs/examples/``), ``qwen-tok/`` (GPT-2 and Qwen3's
template of ``tests/fixtures/chat_templates/``), ``tokenizer.json``, ``a.jsonl.gz``,
``b.parquet``, ``caches/{web,code,math}/``. Only the step counts of the
training examples are cut (``STEPS``): the rest runs verbatim. An example that cannot run here is marked
in its file by ``<!-- example: skip (why) -->`` on the line before it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CORPUS, run_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?P<mark><!-- example: skip \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```", re.S)
#: Training examples show a real run's length on a GPU; here each trains two steps on the CPU (TRL's
#: config asks for bf16 by default, which a CPU refuses).
STEPS = {
    "max_steps=10_000": "max_steps=2",
    "max_steps=1_000": "max_steps=2",
    'trl.SFTConfig("sft-out",': 'trl.SFTConfig("sft-out", bf16=False,',
}


def examples(doc: str) -> list[tuple[int, str, str | None]]:
    """(line, code, why it is skipped or None) of every Python example in ``doc``."""
    text = (ROOT / doc).read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text[: match.start("code")].count("\n") + 1
        found.append((line, match.group("code"), match.group("why")))
    return found


def _texts(count: int) -> list[str]:
    import zstandard

    with zstandard.open(SAMPLE_CORPUS, "rt") as f:
        return [json.loads(next(f))["text"] for _ in range(count)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer: Path) -> Path:
    """A folder with the caches, inputs and tokenizer folders the examples name."""
    if not SAMPLE_CORPUS.exists():
        pytest.skip(f"the sample corpus is absent ({SAMPLE_CORPUS})")
    here = tmp_path_factory.mktemp("examples")
    texts = _texts(240)
    shutil.copy(gpt2_tokenizer, here / "tokenizer.json")
    (here / "tok").mkdir()
    shutil.copy(gpt2_tokenizer, here / "tok" / "tokenizer.json")
    (here / "chat-tok").mkdir()
    shutil.copy(gpt2_tokenizer, here / "chat-tok" / "tokenizer.json")
    shutil.copy(ROOT / "docs" / "examples" / "chat_template.jinja", here / "chat-tok")
    (here / "qwen-tok").mkdir()
    shutil.copy(gpt2_tokenizer, here / "qwen-tok" / "tokenizer.json")
    qwen3 = ROOT / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
    shutil.copy(qwen3, here / "qwen-tok" / "chat_template.jinja")
    (here / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with gzip.open(here / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:20])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[20:40]}), here / "b.parquet")
    sft = [{"prompt": t[:300], "response": t[300:700]} for t in texts[:60]]
    (here / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    builds = [
        ["docs.jsonl", "--out", "cache/"],
        ["sft.jsonl", "--fields", "prompt,response", "--tokenizer", "tok/", "--out", "sft-cache/"],
        *[[f"{name}.jsonl", "--out", f"caches/{name}/"] for name in ("web", "code", "math")],
    ]
    for k, name in enumerate(("web", "code", "math")):
        part = texts[80 * k : 80 * (k + 1)]
        (here / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    for args in builds:
        if "--tokenizer" not in args:
            args = [*args, "--tokenizer", "tokenizer.json"]
        done = run_cli("build", *args, cwd=here)
        assert done.returncode == 0, done.stderr
    return here


def _script(doc: str) -> str:
    parts = []
    for number, (line, code, why) in enumerate(examples(doc)):
        if why:
            continue
        for long, short in STEPS.items():
            code = code.replace(long, short)
        parts.append(f"print('--- example {number} ({doc}:{line})', flush=True)\n{code}")
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if examples(d)])
def test_the_examples_of_a_doc_run(doc: str, workspace: Path) -> None:
    script = workspace / f"{Path(doc).stem}_examples.py"
    script.write_text(_script(doc))
    if doc == "docs/FORMAT.md":  # the reader it shows must give every document of a real cache
        script.write_text(
            script.read_text()
            + "\nimport numpy, streampack\nc = streampack.open('cache/')\n"
            + "assert all(numpy.array_equal(d, c.doc(i)) for i, d in enumerate(read_cache('cache/')))\n"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=workspace, capture_output=True, text=True, timeout=900, env=env
    )
    ran = [line for line in done.stdout.splitlines() if line.startswith("--- example")]
    assert done.returncode == 0, f"after {ran[-1] if ran else 'no example'}:\n{done.stderr[-4000:]}"


def test_every_skipped_example_says_why() -> None:
    for doc in DOCS:
        for line, _, why in examples(doc):
            assert why is None or why.strip(), f"{doc}:{line}: a skipped example must say why"


def test_there_are_examples_to_run() -> None:
    assert sum(why is None for doc in DOCS for _, _, why in examples(doc)) >= 10
