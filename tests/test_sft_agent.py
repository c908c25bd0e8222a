"""Reasoning and agent SFT with the real chat templates of Qwen3, Llama 3.3 and gpt-oss
(``tests/fixtures/chat_templates/``): templates that drop earlier turns' reasoning, tool calls, tool messages
and a record's tools. Each build is checked against a brute-force model that knows each family's format:
it reads the rendered conversation and says, character by character, which belong to an assistant turn's
trained text under the loss policy, from the messages alone (never from the code under test)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack
from streampack.errors import BadRecordError, OptionsError
from streampack.inputs.sft import ChatError, ChatTemplate
from tests.conftest import write_jsonl
from tests.test_sft import chat_tokenizer, encoder

jinja2 = pytest.importorskip("jinja2")

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
Message = dict[str, Any]
POLICIES = [(turns, reasoning) for turns in ("all", "last") for reasoning in ("train", "mask")]


# ------------------------------------------------------------------------ brute force: the families' formats


def render(family: str, messages: list[Message], tools: list[Any] | None) -> str:
    """The whole conversation rendered by jinja2 as transformers renders it (a fixed date for gpt-oss)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["strftime_now"] = lambda fmt: "2025-01-01"

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    source = (TEMPLATES / f"{family}.jinja").read_text()
    variables = {"bos_token": "<|begin_of_text|>"} if family == "llama3.3" else {}
    return env.from_string(source).render(messages=messages, tools=tools, **variables)


def blocks(text: str, start: str, ends: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """Each block from ``start`` to the first of ``ends`` after it: (start, after ``start``, end)."""
    found, at = [], 0
    while (a := text.find(start, at)) >= 0:
        b = min(e for end in ends if (e := text.find(end, a + len(start))) >= 0)
        b += next(len(end) for end in ends if text.startswith(end, b))
        found.append((a, a + len(start), b))
        at = b
    return found


def assistant_turns(family: str, text: str, messages: list[Message]) -> list[tuple[int, int, int | None]]:
    """Each assistant message's turn in ``text``: (target start, end, end of its printed reasoning or
    None), read off the family's delimiters."""
    assistants = [m for m in messages if m["role"] == "assistant"]
    if family == "qwen3":
        turns = []
        for (_, head, end), m in zip(blocks(text, "<|im_start|>assistant\n", ("<|im_end|>\n",)), assistants):
            thought = text.find("\n</think>\n\n", head, end) if m.get("reasoning_content") else -1
            turns.append((head, end, thought if thought >= 0 else None))
        return turns
    if family == "llama3.3":
        head = "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return [(h, e, None) for _, h, e in blocks(text, head, ("<|eot_id|>",))]
    # gpt-oss: an analysis block (the thinking, or a tool call's content) before a final or call block
    found = blocks(text, "<|start|>assistant", ("<|end|>", "<|call|>", "<|return|>"))
    turns, k = [], 0
    for m in assistants:
        first = found[k]
        analysis = text.startswith("<|channel|>analysis", first[1])
        if analysis:
            k += 1
        thought = first[2] - len("<|end|>") if analysis and m.get("thinking") else None
        turns.append((first[1], found[k][2], thought))
        k += 1
    assert k == len(found)
    return turns


def brute_force_targets(
    family: str, messages: list[Message], tools: list[Any] | None, turns: str, reasoning: str
) -> tuple[str, list[bool]]:
    """The rendered text and, per character, whether it is a target."""
    text = render(family, messages, tools)
    found = assistant_turns(family, text, messages)
    assert len(found) == sum(m["role"] == "assistant" for m in messages)
    target = [False] * len(text)
    for start, end, thought in found[-1:] if turns == "last" else found:
        if reasoning == "mask" and thought is not None:
            start = thought
        target[start:end] = [True] * (end - start)
    return text, target


def segment_targets(template: ChatTemplate, messages: list[Message], tools: list[Any] | None) -> tuple:
    segments = template.segments(messages, tools)
    return "".join(s.text for s in segments), [s.target for s in segments for _ in s.text]


def chat_template(family: str, turns: str = "all", reasoning: str = "train") -> ChatTemplate:
    variables = (("bos_token", "<|begin_of_text|>"),) if family == "llama3.3" else ()
    source = (TEMPLATES / f"{family}.jinja").read_text()
    return ChatTemplate("messages", source, family, variables, turns, reasoning)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- conversations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def call(arguments: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "weather", "arguments": arguments}}


REASONING_KEY = {"qwen3": "reasoning_content", "gpt-oss": "thinking", "llama3.3": None}

texts = st.text(st.sampled_from('ab Z1\n{}":,.'), min_size=1, max_size=12)


@st.composite
def conversations(draw: Callable[..., Any], family: str) -> tuple[list[Message], list[Any] | None]:
    """A conversation each family accepts: a system message or not, then user questions each answered by
    tool-call rounds (a call, its tool response) and a final answer, with reasoning or not."""
    key = REASONING_KEY[family]
    messages: list[Message] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(texts)})
        for _ in range(draw(st.integers(0, 2))):
            step: Message = {"role": "assistant", "content": "", "tool_calls": [call(draw(texts))]}
            if key is not None and draw(st.booleans()):
                step[key] = draw(texts)
            messages += [step, {"role": "tool", "content": draw(texts)}]
        answer: Message = {"role": "assistant", "content": draw(texts)}
        if key is not None and draw(st.booleans()):
            answer[key] = draw(texts)
        messages.append(answer)
    tools = TOOLS if draw(st.booleans()) or family == "gpt-oss" else None
    if family == "llama3.3" and tools is None:
        for m in messages:  # without tools, Llama 3.3 writes a tool call's JSON all the same
            m.pop("tool_calls", None)
    return messages, tools


@pytest.mark.parametrize("family", ["qwen3", "llama3.3", "gpt-oss"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_targets_are_the_brute_force_ones(family: str, data: st.DataObject) -> None:
    """Property: for random agent conversations and every loss policy, the segments' text is the render and
    their targets are the characters the brute-force model says."""
    messages, tools = data.draw(conversations(family))
    turns, reasoning = data.draw(st.sampled_from(POLICIES))
    got = segment_targets(chat_template(family, turns, reasoning), messages, tools)
    assert got == brute_force_targets(family, messages, tools, turns, reasoning)


# ----------------------------------------------------------------------------------------- real builds

SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>"],
    "llama3.3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
    "gpt-oss": ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"],
}


# A special token of each family that its delimiters do not hold alone: in a message, it stays text.
IN_TEXT = {"qwen3": "<|im_start|>", "llama3.3": "<|end_header_id|>", "gpt-oss": "<|message|>"}


def agent_conversation(family: str) -> list[Message]:
    key = REASONING_KEY[family] or "unused"
    special = IN_TEXT[family]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Weather in Paris? Say {special}."},
        {"role": "assistant", "content": "", key: "Ask the tool.", "tool_calls": [call('{"city": "Paris"}')]},
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": f"Sunny {special}.", key: "The tool said sunny."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Welcome.", key: "Be polite."},
    ]


@pytest.mark.parametrize("family", ["qwen3", "llama3.3", "gpt-oss"])
def test_a_build_marks_the_brute_force_targets(tmp_path: Path, gpt2_tokenizer: Path, family: str) -> None:
    """The tokens a build marks, decoded back to characters, are the brute-force targets, under each
    policy; the template's special-token strings are their ids, the messages' stay text."""
    folder = tmp_path / "tok"
    tokenizer = chat_tokenizer(gpt2_tokenizer, folder, "", SPECIALS[family])
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    (folder / "chat_template.jinja").write_text((TEMPLATES / f"{family}.jinja").read_text())
    messages = agent_conversation(family)
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": messages, "tools": TOOLS}])
    decode = encoder(tokenizer, parse=True)
    for turns, reasoning in POLICIES:
        out = tmp_path / f"c-{turns}-{reasoning}"
        streampack.build(
            src,
            out,
            tokenizer=str(folder),
            chat="messages",
            eos=False,
            chat_turns=turns,
            chat_reasoning=reasoning,
        )
        cache = streampack.open(out)
        tokens, mask = cache.doc(0).tolist(), cache.doc_loss_mask(0).tolist()
        pieces = [decode.decode([t], skip_special_tokens=False) for t in tokens]
        got = "".join(pieces), [bool(m) for p, m in zip(pieces, mask) for _ in p]
        assert got == brute_force_targets(family, messages, TOOLS, turns, reasoning)
        special = IN_TEXT[family]
        assert tokens.count(decode.token_to_id(special)) == got[0].count(special) - 2  # not the messages'
        assert (
            cache.manifest.settings.chat_turns == turns
            and cache.manifest.settings.chat_reasoning == reasoning
        )


def test_a_template_whose_turns_cannot_be_found_is_refused_by_name() -> None:
    """A template that writes an assistant turn outside its loop over the messages cannot be traced."""
    source = (
        "{% for m in messages[:-1] %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if messages | length > 2 %}!{% endif %}<assistant>{{ messages[-1].content }}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    template = ChatTemplate("messages", source, "odd.jinja")
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    with pytest.raises(ChatError, match=r"odd\.jinja renders .* assistant turn 3 outside its loop"):
        template.segments(conversation)


def test_policies_without_a_chat_are_refused(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match=r"chat_turns='last' .* give chat=FIELD too"):
        streampack.build(streampack.Documents(["a"]), tmp_path / "c", chat_turns="last")
    with pytest.raises(OptionsError, match="chat_reasoning must be one of"):
        streampack.build(streampack.Documents(["a"]), tmp_path / "c", chat="m", chat_reasoning="drop")


# ------------------------------------------------------------------------------------- no text is lost

USER = {"role": "user", "content": "Weather?"}
TOOL = {"role": "tool", "content": "sunny"}


def answer(content: str, **reasoning: str) -> Message:
    return {"role": "assistant", "content": content, **reasoning}


@pytest.mark.parametrize(
    ("family", "messages", "problem"),
    [
        (
            "gpt-oss",
            [USER, answer("Sunny.", reasoning_content="Look it up.")],
            r"the 'reasoning_content' of message 1 .* prints 'thinking', not 'reasoning_content': rename",
        ),
        (
            "qwen3",
            [USER, answer("Sunny.", thinking="Look it up.")],
            r"the 'thinking' of message 1 .* prints 'reasoning_content', not 'thinking': rename the field",
        ),
        (
            "llama3.3",
            [USER, answer("Sunny.", reasoning_content="Look it up.")],
            r"the 'reasoning_content' of message 1 .* this template prints no reasoning: drop the field",
        ),
        (
            "llama3.3",
            [USER, {**answer("Let me look."), "tool_calls": [call("{}")]}, TOOL],
            r"the 'content' of message 1 \(role 'assistant'\) .* does not print this message's content",
        ),
        (
            "gpt-oss",
            [USER, {**answer(""), "tool_calls": [call('{"city": "A"}'), call('{"city": "B"}')]}, TOOL],
            r"the .arguments. of a tool call of message 1 .* give each call its own assistant message",
        ),
    ],
)
def test_a_text_the_template_never_prints_is_a_bad_record(
    tmp_path: Path, gpt2_tokenizer: Path, family: str, messages: list[Message], problem: str
) -> None:
    """A content, reasoning or tool call that the template does not print, even where the conversation
    ends with its message, is refused: the record, the message, the field and what to do."""
    folder = tmp_path / "tok"
    chat_tokenizer(gpt2_tokenizer, folder, "", SPECIALS[family])
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    (folder / "chat_template.jinja").write_text((TEMPLATES / f"{family}.jinja").read_text())
    fine = [USER, answer("Sunny.")]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": m, "tools": TOOLS} for m in (fine, messages)])
    with pytest.raises(BadRecordError, match=r"in\.jsonl:2: " + problem):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    summary = streampack.build(
        src, tmp_path / "c", tokenizer=str(folder), chat="messages", on_bad_record="skip", overwrite=True
    )
    assert (summary.num_docs, summary.skipped_records) == (1, 1)


@pytest.mark.parametrize(("family", "key"), [("qwen3", "reasoning_content"), ("gpt-oss", "thinking")])
def test_reasoning_the_template_drops_from_earlier_turns_is_not_trained(family: str, key: str) -> None:
    """Qwen3 and gpt-oss drop earlier turns' reasoning by design: the conversation builds, and only the
    reasoning the template prints (the last turn's) is in the document."""
    messages = [USER, answer("Sunny.", **{key: "OLD"}), USER, answer("Still sunny.", **{key: "NEW"})]
    text, targets = segment_targets(chat_template(family), messages, TOOLS)
    assert "OLD" not in text and targets[text.index("NEW")]
    assert (text, targets) == brute_force_targets(family, messages, TOOLS, "all", "train")


def test_a_content_only_template_that_skips_a_message_is_refused() -> None:
    """A template proven to only print contents, which skips the system message's, is refused all the
    same (its plan is not used)."""
    source = (
        "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    template = ChatTemplate("messages", source, "skip.jinja")
    conversation = [{"role": "system", "content": "Be brief."}, USER, answer("Sunny.")]
    with pytest.raises(ChatError, match=r"the 'content' of message 0 \(role 'system'\) .* skip\.jinja"):
        template.segments(conversation)
    assert template.segments([{"role": "system", "content": ""}, USER, answer("Sunny.")])


@pytest.mark.parametrize("family", ["qwen3", "llama3.3", "gpt-oss"])
def test_a_null_content_beside_tool_calls_is_empty(tmp_path: Path, gpt2_tokenizer: Path, family: str) -> None:
    """OpenAI writes ``"content": null`` in an assistant message with tool calls: it builds as ``""``."""
    folder = tmp_path / "tok"
    chat_tokenizer(gpt2_tokenizer, folder, "", SPECIALS[family])
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    (folder / "chat_template.jinja").write_text((TEMPLATES / f"{family}.jinja").read_text())
    calling = {"role": "assistant", "tool_calls": [call('{"city": "Paris"}')]}
    records = [
        {"messages": [USER, {**calling, "content": content}, TOOL, answer("Sunny.")], "tools": TOOLS}
        for content in ("", None)
    ]
    streampack.build(
        write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "c", tokenizer=str(folder), chat="messages"
    )
    cache = streampack.open(tmp_path / "c")
    assert cache.doc(0).tolist() == cache.doc(1).tolist()
    assert cache.doc_loss_mask(0).tolist() == cache.doc_loss_mask(1).tolist()


@pytest.mark.parametrize(
    "snippet",
    [
        "{{ messages.append(1) }}",
        "{{ messages[0].clear() }}",
        "{{ messages[0].update }}",
        "{{ messages[0].items() | list }}",
        "{{ messages[0].role.__class__ }}",
        "{{ ''.__class__.__mro__ }}",
        "{{ messages[0].content.upper() }}",
        "{% for m in messages %}{{ loop.__class__ }}{{ loop.index0 }}{% endfor %}",
        "{% set ns = namespace(a=1) %}{{ ns.__init__ }}{{ ns.a }}{{ ns.b }}",
        "{{ messages[0].missing is defined }}{{ messages[0].get('role') }}",
        "{{ '{}!'.format(messages[0].role) }}{{ messages[0].role.format is defined }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{% for m in messages %}{{ m.content.upper() }}{{ m.content.upper() }}{% endfor %}",
    ],
)
def test_the_sandbox_allows_what_jinja2s_allows(snippet: str) -> None:
    """The sandbox's checks made once per type and attribute give jinja2's own answers: the same render,
    or the same refusal."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "user", "content": "hi"}]
    try:
        expected: str | type[Exception] = env.from_string(snippet).render(messages=messages)
    except jinja2.exceptions.SecurityError:
        expected = ChatError
    template = ChatTemplate("messages", snippet, "probe.jinja")
    if expected is ChatError:
        with pytest.raises(ChatError, match=r"probe\.jinja"):
            template.render(messages)
    else:
        assert template.render(messages) == expected


def test_a_template_that_prints_no_tool_calls_refuses_them() -> None:
    """The docs' ChatML template prints contents only: a tool call would be lost, so it is refused."""
    source = (
        Path(__file__).resolve().parent.parent / "docs" / "examples" / "chat_template.jinja"
    ).read_text()
    template = ChatTemplate("messages", source, "chatml.jinja")
    conversation = [USER, {**answer(""), "tool_calls": [call('{"city": "Paris"}')]}, TOOL, answer("Sunny.")]
    with pytest.raises(ChatError, match=r"'arguments' of a tool call of message 1 .* prints no tool calls"):
        template.segments(conversation)
