"""Chat templates proven to only print the contents are rendered once per conversation shape
(``streampack/inputs/chat_proof.py``, ``chat_plan.py``): the proof refuses every template in which a
content could decide what is rendered, and the plan gives the segments that rendering each conversation
gives."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack
from streampack.inputs import sft
from streampack.inputs.chat_proof import Proof, content_only_printed
from streampack.inputs.sft import ChatError, ChatTemplate
from tests.conftest import write_jsonl
from tests.test_sft import CHATML, CHATML_TOKENS, LLAMA3, chat_tokenizer, docs_and_masks

pytest.importorskip("jinja2")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
SYSTEM_FIRST = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system = 'You help.' %}{% endif %}<<SYS>>{{ system }}<</SYS>>"
    "{% for message in loop_messages %}{% if loop.first %}[first]{% endif %}"
    "{{ message.role }}: {{ message.content }}{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SET_BLOCK = (
    "{% set ns = namespace(turns=0) %}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% set ns.turns = ns.turns + 1 %}{% endif %}"
    "{% set turn %}<{{ m.role }}>[{{ ns.turns }}]{{ m.content | trim }}</{{ m.role }}>{% endset %}"
    "{% if m.content is string and m.content is not mapping and 'name' not in m %}{{ turn }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Qwen 2.5's shape: an assistant turn's content written only where it is not empty (a truth test).
QWEN = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role }}"
    "{% if m.content and not (m.role == 'tool') %}{{ '\n' + m.content }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROVEN = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "system": SYSTEM_FIRST,
    "set": SET_BLOCK,
    "qwen": QWEN,
}

UNPROVEN = {
    "a content's truth as a value": "{% for m in messages %}{{ m.content or 'empty' }}{% endfor %}",
    "a content compared": "{% for m in messages %}{{ 'x' if m.content == 'a' else 'y' }}{% endfor %}",
    "a content filtered": "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
    "a content counted": "{% for m in messages %}{{ m.content | length }}{% endfor %}",
    "a content indexed": "{% for m in messages %}{{ m.content[0] }}{% endfor %}",
    "a content's method": "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",
    "a content looped over": "{% for m in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}",
    "a message's get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "a message printed": "{% for m in messages %}{{ m }}{% endfor %}",
    "a message serialised": "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "the messages serialised": "{{ messages | tojson }}",
    "a computed key": "{% for m in messages %}{% for k in ['content'] %}{{ m[k] }}{% endfor %}{% endfor %}",
    "a content passed to a call": "{% for m in messages %}{{ raise_exception(m.content) }}{% endfor %}",
    "a macro that prints a content": (
        "{% macro show(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ show(m) }}{% endfor %}"
    ),
    "a named content trimmed": "{% for m in messages %}{% set c = m.content %}{{ c | trim }}{% endfor %}",
    "a namespace holding a content": (
        "{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m.content %}{% endfor %}"
        "{{ ns.c }}"
    ),
    "a content in a set block tested": (
        "{% for m in messages %}{% set t %}{{ m.content }}{% endset %}{% if t | length %}x{% endif %}"
        "{% endfor %}"
    ),
    "the previous message": "{% for m in messages %}{{ loop.previtem }}{% endfor %}",
    "a recursive loop": "{% for m in messages recursive %}{{ m.role }}{% endfor %}",
    "an include": "{% include 'other' %}",
    "a name of two kinds": "{% set x = messages %}{% set x = 'a' %}{% for m in x %}{{ m }}{% endfor %}",
}


def template(source: str) -> ChatTemplate:
    return ChatTemplate("messages", source, "test", (("bos_token", "<s>"), ("eos_token", "</s>")))


def proof(source: str) -> Proof:
    return content_only_printed(source, sft._compiled(source).environment)


@pytest.mark.parametrize("source", PROVEN.values(), ids=PROVEN.keys())
def test_templates_that_only_print_contents_are_proven(source: str) -> None:
    found = proof(source)
    assert found.unproven is None
    assert found.needs_non_blank == (source == QWEN)  # it tests a content's truth: true of any non-blank


@pytest.mark.parametrize("source", UNPROVEN.values(), ids=UNPROVEN.keys())
def test_templates_in_which_a_content_could_decide_are_not(source: str) -> None:
    assert proof(source).unproven is not None


def rendered(chat: ChatTemplate, messages: list[dict[str, Any]]) -> Any:
    """The segments as a render of the conversation itself finds them (the path of unproven templates)."""
    try:
        return chat._rendered(messages, None)
    except ChatError as e:
        return str(e)


def planned(chat: ChatTemplate, messages: list[dict[str, Any]]) -> Any:
    try:
        return chat.segments(messages)
    except ChatError as e:
        return str(e)


contents = st.lists(
    st.sampled_from(["a", "b", " ", "\n", "\t", "<|im_end|>", "[INST]", "\ue000", "1", "\ue001", "é"]),
    max_size=8,
).map("".join)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": contents}),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize("source", PROVEN.values(), ids=PROVEN.keys())
@settings(max_examples=150, deadline=None)
@given(conversation=messages)
def test_a_shapes_plan_gives_the_segments_of_the_conversations_render(
    source: str, conversation: list[dict[str, Any]]
) -> None:
    chat = template(source)
    assert planned(chat, conversation) == rendered(chat, conversation)


def test_a_build_renders_once_per_shape_and_gives_the_same_cache(
    tmp_path: Path, gpt2_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS).parent
    conversations = [
        [
            {"role": "user", "content": f" question {i} <|im_end|>"},
            {"role": "assistant", "content": "yes " * (i % 7)},
            *([{"role": "user", "content": "and?"}] if i % 3 else []),
        ]
        for i in range(200)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": c} for c in conversations])
    renders: list[int] = []
    render = ChatTemplate.render

    def counted(self: ChatTemplate, *args: Any, **kwargs: Any) -> str:
        renders.append(1)
        return render(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", counted)
    sft._plan_of.cache_clear()
    streampack.build(src, tmp_path / "planned", tokenizer=str(folder), chat="messages", workers=1)
    assert 0 < len(renders) <= 2 * 6  # two shapes, each a few renders: none per conversation

    monkeypatch.setattr(sft, "_proof", lambda source: Proof("switched off"))
    sft._trace_of.cache_clear()
    planned = len(renders)
    streampack.build(src, tmp_path / "rendered", tokenizer=str(folder), chat="messages", workers=1)
    # each conversation once, and each of its four shapes a few times (marked, prefixes)
    assert len(conversations) < len(renders) - planned <= len(conversations) + 4 * 3
    assert docs_and_masks(tmp_path / "planned") == docs_and_masks(tmp_path / "rendered")
    shards = sorted(p.relative_to(tmp_path / "planned") for p in (tmp_path / "planned" / "shards").rglob("*"))
    assert len(shards) > 1
    for name in shards:
        planned_file, rendered_file = tmp_path / "planned" / name, tmp_path / "rendered" / name
        assert planned_file.is_dir() or planned_file.read_bytes() == rendered_file.read_bytes()


@pytest.mark.parametrize("kinds", ["", "p", "t", "tpt", "ptpptttp", "tttt"])
def test_a_batchs_two_kinds_of_ids_are_interleaved_in_order(
    tmp_path: Path, gpt2_tokenizer: Path, kinds: str
) -> None:
    from streampack.builder.blocks import encode_with_templates
    from streampack.tokenizer import load_tokenizer

    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS).parent
    tokenizer = load_tokenizer(str(folder))
    texts = [f"<|im_start|>user\n{i % 2}" if k == "t" else f"a <|im_end|> {i}" for i, k in enumerate(kinds)]
    templated = [k == "t" for k in kinds]
    ids, offsets = encode_with_templates(tokenizer, texts, templated)
    expected = [
        (tokenizer.encode_specials([t]) if special else tokenizer.encode_batch([t]))[0].tolist()
        for t, special in zip(texts, templated)
    ]
    assert [ids[a:b].tolist() for a, b in itertools.pairwise(offsets)] == expected


def test_an_sft_document_joins_its_batch_at_once_as_piece_by_piece(
    tmp_path: Path, gpt2_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streampack.tokenizer.pieces import PieceRule

    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS).parent
    conversations = [
        [{"role": "user", "content": "q " * (i % 40)}, {"role": "assistant", "content": f"a{i} " * (i % 9)}]
        for i in range(120)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": c} for c in conversations])
    options = {"tokenizer": str(folder), "chat": "messages", "workers": 1, "batch_chars": 300}
    streampack.build(src, tmp_path / "at-once", verify_tokens="all", **options)
    monkeypatch.setattr(PieceRule, "whole_chars", property(lambda self: -1))  # every piece on its own
    streampack.build(src, tmp_path / "by-piece", verify_tokens="all", **options)
    assert docs_and_masks(tmp_path / "at-once") == docs_and_masks(tmp_path / "by-piece")


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral", "set", "qwen"])
def test_a_conversation_of_a_proven_template_is_planned(name: str) -> None:
    chat = template(PROVEN[name])
    conversation = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert sft._plan_of(chat, sft._plan_key(conversation)) is not None


def test_template_pieces_share_the_reference_instance_one_call_at_a_time(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """With fastokens as the engine, template pieces are parsed by the reference's own instance, its
    special-token setting changed only for them: threads checking samples meanwhile still get text-mode ids,
    and the template pieces get the ids of a separate parse-mode instance; no second instance is loaded."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer as HFTokenizer

    from streampack.tokenizer import load_tokenizer

    pytest.importorskip("fastokens")
    path = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
    tokenizer = load_tokenizer(str(path.parent))
    assert tokenizer.engine.name == "fastokens"
    parsing = HFTokenizer.from_file(str(path))
    texting = HFTokenizer.from_file(str(path))
    texting.encode_special_tokens = True
    templates = [f"<|im_start|>user\n{i}<|im_end|>\n" * 50 for i in range(40)]
    contents = [f"a <|im_end|> b <|im_start|> {i} " * 50 for i in range(40)]
    want_templates = [e.ids for e in parsing.encode_batch(templates, add_special_tokens=False)]
    want_contents = [e.ids for e in texting.encode_batch(contents, add_special_tokens=False)]

    def template(i: int) -> list[int]:
        return tokenizer._parse_specials([templates[i]])[0].tolist()

    def content(i: int) -> list[int]:
        return tokenizer.reference_engine().encode_batch([contents[i]])[0].tolist()

    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got_templates = pool.map(template, range(40))
            got_contents = pool.map(content, range(40))
            assert list(got_templates) == want_templates
            assert list(got_contents) == want_contents
    assert tokenizer._parsing is None  # no second instance
