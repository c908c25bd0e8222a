"""Supervised fine-tuning documents: segments of text, each tokenized on its own, each a target or not.

Fields (``fields=["prompt", "response"]``): the last field is the target. Chat (``chat="messages"``): the
conversation is rendered as ``transformers`` renders it (``strftime_now`` prints a fixed day, so that a cache
never depends on the day), and the assistant turns are the targets, found by rendering prefixes: the render of
``messages[:i]`` with the generation prompt must be a prefix of the whole, and that of ``messages[:i + 1]``
ends after turn ``i`` (or, for a template that drops earlier turns' reasoning, by where its loop over the
messages starts each one). Special-token strings the template writes become their ids; the texts stay text,
told apart by rendering the conversation's shape: its messages and tools with each text replaced by a marker.
All but the conversation's own render is done once per shape (a :class:`_Trace`), and checked against that
render. A text the template does not print is refused, unless the template drops it by design (an earlier
turn's reasoning). Where the template is proven to only print the contents
(:mod:`~streampack.inputs.chat_proof`), conversations are not rendered at all but filled into a plan made once
per shape (:mod:`~streampack.inputs.chat_plan`).
"""

from __future__ import annotations

import bisect
import datetime
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from streampack.errors import TokenizerError, extra_needed
from streampack.inputs.chat_plan import MARKER, Plan, marker, plan, runs
from streampack.inputs.chat_proof import Proof, content_only_printed
from streampack.inputs.segments import Segment, Sft

if TYPE_CHECKING:
    from jinja2 import Template

    from streampack.tokenizer.base import Tokenizer

# The special-token strings of a tokenizer_config.json that transformers passes to a template.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


ChatTurns = Literal["all", "last"]
ChatReasoning = Literal["train", "mask"]
CHAT_TURNS: tuple[ChatTurns, ...] = ("all", "last")
CHAT_REASONING: tuple[ChatReasoning, ...] = ("train", "mask")

# A message's texts that are kept as text (never parsed for special tokens), besides the tool calls'
# arguments: its content and its reasoning, under the names templates read it by (Qwen3's, gpt-oss's).
REASONING_KEYS = ("reasoning_content", "thinking")
_TEXT_KEYS = ("content", *REASONING_KEYS)
# The day ``strftime_now`` prints (gpt-oss's template asks it): fixed, so that a cache never depends on the
# day it was built.
CHAT_DATE = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
# The key under which each message carries its turn's marker to an instrumented template (see _turn_marks).
_TURN_KEY = "\ue002turn"
_TURN = re.compile("\ue002([0-9]+)\ue003")


class ChatError(ValueError):
    """A conversation that the chat template cannot render, or whose turns cannot be traced."""


def field_segments(values: list[str]) -> Sft:
    """The segments of a record's field values: all prompt, but the last, which is the target."""
    last = len(values) - 1
    return tuple(Segment(value, i == last) for i, value in enumerate(values))


def check_messages(messages: Any, field: str) -> list[dict[str, Any]]:
    """``messages`` if it is a list of ``{role, content}`` objects with string values, whose reasoning
    (``reasoning_content``, ``thinking``) is a string and ``tool_calls`` a list of objects where present;
    an assistant message with tool calls and a null (or no) content, as OpenAI writes it, gets ``""``.

    Raises:
        ChatError: saying what is wrong with it.
    """
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else _kind(messages)
        raise ChatError(f"the {field!r} field is {what}, expected a list of {{role, content}} messages")
    messages = [_content_of_call(message) for message in messages]
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"{field}[{i}] is {_kind(message)}, expected an object with role and content")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                found = "missing" if key not in message else _kind(message[key])
                raise ChatError(f"{field}[{i}].{key} is {found}, expected a string")
        for key in REASONING_KEYS:
            if key in message and not isinstance(message[key], str):
                raise ChatError(f"{field}[{i}].{key} is {_kind(message[key])}, expected a string")
        calls = message.get("tool_calls", [])
        if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ChatError(f"{field}[{i}].tool_calls is {_kind(calls)}, expected a list of objects")
    return messages


def _content_of_call(message: Any) -> Any:
    """An assistant message with tool calls and a null or no content with ``""`` for it; others as given."""
    if (
        isinstance(message, dict)
        and message.get("content") is None
        and message.get("role") == "assistant"
        and message.get("tool_calls")
    ):
        return {**message, "content": ""}
    return message


def check_tools(tools: Any) -> list[Any] | None:
    """A record's ``tools``: a list (of the tools' JSON schemas), or None where the record has none.

    Raises:
        ChatError: it is neither.
    """
    if tools is None or isinstance(tools, list):
        return tools
    raise ChatError(f"the 'tools' field is {_kind(tools)}, expected a list of tool schemas")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template, the variables it is rendered with and what it trains on (picklable: workers
    compile it).

    Attributes:
        field: the record field that holds the messages.
        source: the Jinja source of the template.
        origin: the file it was read from.
        variables: the config's special-token strings (``bos_token``, ...), as (name, value) pairs.
        turns: ``all``: every assistant turn is a target; ``last``: the last one only.
        reasoning: ``train``: an assistant turn's reasoning, as the template prints it, is a target;
            ``mask``: the turn's target starts after its reasoning.
    """

    field: str
    source: str
    origin: str
    variables: tuple[tuple[str, str], ...] = ()
    turns: ChatTurns = "all"
    reasoning: ChatReasoning = "train"

    @property
    def sha256(self) -> str:
        """Hash of the template and its variables: what the manifest records of it."""
        text = json.dumps([self.source, list(self.variables)], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[Any] | None = None,
        *,
        instrumented: bool = False,
    ) -> str:
        """The template's text for ``messages`` (and a record's ``tools``); ``instrumented``: with each
        message's turn marker where the template's loop over the messages starts it (see
        :func:`_instrumented`).

        Raises:
            ChatError: the template refused them (``raise_exception``) or failed on them.
        """
        import jinja2

        template = _instrumented(self.source) if instrumented else _compiled(self.source)
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **dict(self.variables),
            )
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template of {self.origin} refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            # (RecursionError: a value nested too deeply for the template's tojson, say)
            raise ChatError(
                f"the chat template of {self.origin} failed on the conversation ({type(e).__name__}: {e})"
            ) from None

    def segments(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> Sft:
        """The conversation as segments: template text and texts, the assistant turns (as :attr:`turns`
        and :attr:`reasoning` say) as targets.

        Raises:
            ChatError: the template cannot render the conversation, its turns cannot be found, or it changes
                a text in a way that cannot be traced.
        """
        if tools is None and not any(_AGENT_KEYS & m.keys() for m in messages):
            proof = _proof(self.source)
            proven = proof.unproven is None and not (proof.needs_non_blank and _any_blank(messages))
            key = _plan_key(messages) if proven else None
            shape_plan = None if key is None else _plan_of(self, key)
            if shape_plan is not None:
                return shape_plan.segments(messages)
        return self._rendered(messages, tools)

    def _rendered(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Sft:
        """:meth:`segments` found in the render of the conversation itself, by its shape's trace."""
        full = self.render(messages, tools=tools)
        marked = _marked(messages)
        key = _trace_key(marked, tools)
        trace = _trace(self, marked, tools) if key is None else _trace_of(self, key)
        if trace.error is not None:
            raise ChatError(trace.error)
        holes = _holes(messages)
        contents, starts = self._text_spans(trace.parts, full, holes)
        turns = [(i, starts[a] + x, starts[b] + y) for i, (a, x), (b, y) in trace.turns]
        if self.turns == "last":
            turns = turns[-1:]
        reasoning: dict[int, list[int]] = {}  # where each message's reasoning ends, where it is printed
        for _, b, k in contents if self.reasoning == "mask" else ():
            if holes[k][1] in REASONING_KEYS:
                reasoning.setdefault(holes[k][0], []).append(b)
        targets = []
        for i, start, end in turns:
            # chat_reasoning="mask": the target starts after the turn's reasoning
            start = max([start, *(b for b in reasoning.get(i, ()) if start <= b <= end)])
            if start < end:
                targets.append((start, end))
        return _runs(full, targets, [(a, b) for a, b, _ in contents])

    def _text_spans(
        self, parts: tuple[str, ...], full: str, holes: list[tuple[int, str, str]]
    ) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Where the messages' texts lie in ``full`` (start, end, hole), and where each literal text of
        the skeleton ``parts`` starts in it: the skeleton with each marker replaced by its text, as given
        or as a template prints it (stripped, or as a JSON string).

        Raises:
            ChatError: ``full`` is not so.
        """
        spans: list[tuple[int, int, int]] = []
        starts = [0]
        at = 0
        for k in range(0, len(parts) - 1, 2):
            text, index, after = parts[k], int(parts[k + 1]), parts[k + 2]
            if not full.startswith(text, at) or index >= len(holes):
                break  # (an index past the holes: a marker in another field of a message)
            at += len(text)
            found = next(
                (
                    v
                    for v in _printed_forms(holes[index][2])
                    if full.startswith(v, at) and full.startswith(after, at + len(v))
                ),
                None,
            )
            if found is None:
                message, key, _ = holes[index]
                raise ChatError(
                    f"the chat template of {self.origin} changes the {key} of message {message} (other "
                    "than by stripping it or writing it as JSON), so its special-token strings cannot be "
                    "kept as text"
                )
            spans.append((at, at + len(found), index))
            at += len(found)
            starts.append(at)
        if (
            len(starts) != len(parts) // 2 + 1
            or at + len(parts[-1]) != len(full)
            or not full.endswith(parts[-1])
        ):
            raise ChatError(
                f"the chat template of {self.origin} renders the conversation differently when the contents "
                "change, so its own text cannot be told from the contents"
            )
        return spans, starts


# A place in a skeleton: (literal text, offset in it); an assistant turn's target: (message, start, end).
_Place = tuple[int, int]
_Turn = tuple[int, _Place, _Place]


@dataclass(frozen=True)
class _Trace:
    """What the renders of a conversation's shape (its messages with each text a marker, and its tools)
    say of every conversation of that shape.

    Attributes:
        parts: the render split at the markers: literal text, hole index, literal text, ...
        turns: each assistant turn's target, before the loss policies.
        error: why the conversations of this shape are refused (then the rest is empty).
    """

    parts: tuple[str, ...] = ("",)
    turns: tuple[_Turn, ...] = ()
    error: str | None = None


def _trace(template: ChatTemplate, marked: list[dict[str, Any]], tools: list[Any] | None) -> _Trace:
    """The trace of the shape ``marked`` (see :func:`_marked`): its skeleton, the texts the template does
    not print (refused unless dropped by design), and its turns, by prefixes or by the template's loop."""
    try:
        skeleton = _shape_render(template, marked, tools)
        parts = tuple(MARKER.split(skeleton))
        missing = _missing_texts(template, marked, tools, {int(i) for i in parts[1::2]})
        if missing is not None:
            return _Trace(error=missing)
        places = _places(parts)
        turns = _prefix_turns(template, marked, tools, skeleton)
        if turns is None:
            turns = _loop_turns(template, marked, tools, skeleton, parts)
    except ChatError as e:
        return _Trace(error=str(e))
    return _Trace(parts, tuple((i, places(a), places(b)) for i, a, b in turns))


def _places(parts: tuple[str, ...]) -> Callable[[int], _Place]:
    """The place in ``parts`` of an offset in their render (a literal's end where a hole follows it)."""
    starts, at = [], 0
    for k in range(0, len(parts), 2):
        starts.append(at)
        at += len(parts[k]) + (len(marker(int(parts[k + 1]))) if k + 1 < len(parts) else 0)

    def place(offset: int) -> _Place:
        k = bisect.bisect_right(starts, offset) - 1
        if offset - starts[k] > len(parts[2 * k]):
            raise ChatError("a turn starts or ends inside a text")  # (the checks before rule it out)
        return k, offset - starts[k]

    return place


def _missing_texts(
    template: ChatTemplate, marked: list[dict[str, Any]], tools: list[Any] | None, printed: set[int]
) -> str | None:
    """Why a text of ``marked`` that its render does not print is refused; None where there is none, or
    each is one that the template drops from earlier turns by design: an assistant message's reasoning
    (or the content of one with tool calls, which gpt-oss prints as its reasoning) that it prints where
    the conversation ends with that message."""
    for index, (i, key, _) in enumerate(_holes(marked)):
        if index in printed:
            continue
        message = marked[i]
        droppable = message["role"] == "assistant" and (
            key in REASONING_KEYS or (key == "content" and bool(message.get("tool_calls")))
        )
        if droppable and marker(index) in _render_or_empty(template, marked[: i + 1], tools):
            continue
        fix = _fix(template, marked, tools, i, key, printed)
        return (
            f"{_field(i, key, message)} is not in the render of the chat template of {template.origin}: {fix}"
        )
    return None


def _field(i: int, key: str, message: dict[str, Any]) -> str:
    what = "the 'arguments' of a tool call" if key == "arguments" else f"the {key!r}"
    return f"{what} of message {i} (role {message['role']!r})"


def _fix(
    template: ChatTemplate,
    marked: list[dict[str, Any]],
    tools: list[Any] | None,
    i: int,
    key: str,
    printed: set[int],
) -> str:
    """What to do about a text of message ``i`` that the template never prints (``printed``: the holes
    it prints)."""
    if key in REASONING_KEYS:
        other = next(k for k in REASONING_KEYS if k != key)
        renamed = [*marked[:i], {**{k: v for k, v in marked[i].items() if k != key}, other: marked[i][key]}]
        if marked[i][key] in _render_or_empty(template, renamed, tools):
            return f"this template prints {other!r}, not {key!r}: rename the field"
        return "this template prints no reasoning: drop the field, or use a template that prints it"
    if key == "arguments":
        calls = [k for k, (j, other, _) in enumerate(_holes(marked)) if j == i and other == key]
        if printed.intersection(calls):
            return "it prints only some of a message's tool calls: give each call its own assistant message"
        return "this template prints no tool calls: use one that does"
    return "it does not print this message's content: drop it, or use a template that prints it"


def _render_or_empty(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    try:
        return _shape_render(template, messages, tools)
    except ChatError:
        return ""


def _prefix_turns(
    template: ChatTemplate, marked: list[dict[str, Any]], tools: list[Any] | None, skeleton: str
) -> list[tuple[int, int, int]] | None:
    """Each assistant turn (message, start, end) where the template renders the conversation
    incrementally: from the generation prompt after its first ``i`` messages to the end of the render of
    its first ``i + 1``; None where those renders are not prefixes of the whole."""
    spans: list[tuple[int, int, int]] = []
    for i, message in enumerate(marked):
        if message["role"] != "assistant":
            continue
        before = _shape_render(template, marked[:i], tools, prompt=True)
        # A render depends on its arguments alone: the render through the last turn is the whole one.
        through = skeleton if i == len(marked) - 1 else _shape_render(template, marked[: i + 1], tools)
        start = spans[-1][2] if spans else 0
        if not (
            skeleton.startswith(before)
            and skeleton.startswith(through)
            and start <= len(before) <= len(through)
        ):
            return None
        spans.append((i, len(before), len(through)))
    return spans


def _loop_turns(
    template: ChatTemplate,
    marked: list[dict[str, Any]],
    tools: list[Any] | None,
    skeleton: str,
    parts: tuple[str, ...],
) -> list[tuple[int, int, int]]:
    """Each assistant turn (message, start, end) of a template that does not render the conversation
    incrementally (one that drops earlier turns' reasoning): what its loop over the messages renders
    for the turn, after the generation prompt that the template writes for it.

    Raises:
        ChatError: the turns cannot be found so (see the messages).
    """
    why = f"the chat template of {template.origin} renders the conversation otherwise than by its prefixes"
    pieces = _TURN.split(_shape_render(template, marked, tools, instrumented=True))
    if "".join(pieces[::2]) != skeleton:
        raise ChatError(f"{why}, and renders it otherwise when told where each message starts")
    starts: dict[int, int] = {}
    bounds: list[int] = []
    at = 0
    for k in range(1, len(pieces), 2):
        at += len(pieces[k - 1])
        index = int(pieces[k])
        if index in starts:
            raise ChatError(f"{why}, and its loops over the messages render message {index} twice")
        starts[index] = at
        bounds.append(at)
    holes = _holes(marked)
    texts = [
        (m.start(), m.end(), holes[int(m[1])][0]) for m in MARKER.finditer(skeleton) if int(m[1]) < len(holes)
    ]
    spans: list[tuple[int, int, int]] = []
    for i, message in enumerate(marked):
        if message["role"] != "assistant":
            continue
        if i not in starts:
            raise ChatError(f"{why}, and renders assistant turn {i} outside its loop over the messages")
        start = starts[i]
        end = next((b for b in bounds if b > start), len(skeleton))
        prompt = _generation_prompt(template, marked[:i], tools)
        if prompt is None or MARKER.search(prompt) or not skeleton.startswith(prompt, start):
            raise ChatError(
                f"{why}, and assistant turn {i} does not start with the generation prompt it writes "
                f"after the {i} messages before it"
            )
        if any(not start <= a <= b <= end for a, b, owner in texts if owner == i):
            raise ChatError(f"{why}, and prints a text of assistant turn {i} outside the turn")
        spans.append((i, start + len(prompt), end))
    return spans


def _generation_prompt(
    template: ChatTemplate, messages: list[dict[str, Any]], tools: list[Any] | None
) -> str | None:
    """What the generation prompt adds to the render of ``messages``; None where it changes the render."""
    bare = _shape_render(template, messages, tools)
    prompted = _shape_render(template, messages, tools, prompt=True)
    return prompted[len(bare) :] if prompted.startswith(bare) else None


def _trace_key(marked: list[dict[str, Any]], tools: list[Any] | None) -> str | None:
    """The shape ``marked`` and ``tools`` as JSON, which :func:`_trace_of` reads back: everything a render
    sees but the texts; None where JSON cannot hold it exactly (a value that is not JSON's, a key that is
    not a string, a tuple), and the shape's trace is made for the conversation alone."""
    try:
        key = json.dumps([marked, tools], ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return key if json.loads(key) == [marked, tools] else None


@functools.lru_cache(maxsize=1024)
def _trace_of(template: ChatTemplate, key: str) -> _Trace:
    """:func:`_trace` of the shape whose :func:`_trace_key` is ``key``, made once per shape."""
    marked, tools = json.loads(key)
    return _trace(template, marked, tools)


def _shape_render(
    template: ChatTemplate,
    marked: list[dict[str, Any]],
    tools: list[Any] | None,
    *,
    prompt: bool = False,
    instrumented: bool = False,
) -> str:
    """The render of the shape ``marked`` (``instrumented``: with its turn marks), made once per shape: the
    shapes of a corpus share their first messages, whose renders the traces ask for again and again."""
    key = _trace_key(marked, tools)
    if key is None:
        messages = _turn_marks(marked) if instrumented else marked
        return template.render(messages, prompt, tools, instrumented=instrumented)
    return _shape_render_of(template, key, prompt, instrumented)


@functools.lru_cache(maxsize=1024)
def _shape_render_of(template: ChatTemplate, key: str, prompt: bool, instrumented: bool) -> str:
    marked, tools = json.loads(key)
    messages = _turn_marks(marked) if instrumented else marked
    return template.render(messages, prompt, tools, instrumented=instrumented)


# Message keys that only the rendering path knows: a conversation with one is never filled into a plan.
_AGENT_KEYS = {*REASONING_KEYS, "tool_calls"}


def _printed_forms(text: str) -> Iterator[str]:
    """The ways a template prints a text: as given, stripped (``| trim``, ``.strip('\\n')``, ...) or as a
    JSON string (``| tojson``, between the quotes its marker gets), in that order (each made when asked)."""
    yield text
    yield text.strip()
    yield text.strip("\n")
    yield text.lstrip("\n")
    yield json.dumps(text, ensure_ascii=False)[1:-1]


def _holes(messages: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """The messages' texts that are kept as text, in the order :func:`_marked` marks them: (message, key,
    text) of each non-empty content, reasoning and tool call's ``arguments`` string."""
    holes: list[tuple[int, str, str]] = []
    for i, message in enumerate(messages):
        for key in _TEXT_KEYS:
            if isinstance(message.get(key), str) and message[key]:
                holes.append((i, key, message[key]))
        for call in message.get("tool_calls", ()):
            arguments = _call_function(call).get("arguments")
            if isinstance(arguments, str) and arguments:
                holes.append((i, "arguments", arguments))
    return holes


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each text of :func:`_holes` replaced by its marker (empty ones stay empty: a
    template may test whether one is)."""
    count = iter(range(1 << 62))
    result = []
    for message in messages:
        copy = {**message}
        for key in _TEXT_KEYS:
            if isinstance(copy.get(key), str) and copy[key]:
                copy[key] = marker(next(count))
        if "tool_calls" in copy:
            copy["tool_calls"] = [_marked_call(call, count) for call in copy["tool_calls"]]
        result.append(copy)
    return result


def _call_function(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's function: ``call["function"]`` (OpenAI's form), or the call itself."""
    function = call.get("function")
    return function if isinstance(function, dict) else call


def _marked_call(call: dict[str, Any], count: Iterator[int]) -> dict[str, Any]:
    function = _call_function(call)
    arguments = function.get("arguments")
    if not (isinstance(arguments, str) and arguments):
        return call
    marked = {**function, "arguments": marker(next(count))}
    return marked if function is call else {**call, "function": marked}


def _turn_marks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` each with its turn's marker, which an instrumented template prints where its loop over
    the messages starts the message."""
    return [{**m, _TURN_KEY: f"\ue002{i}\ue003"} for i, m in enumerate(messages)]


def _runs(full: str, targets: list[tuple[int, int]], contents: list[tuple[int, int]]) -> Sft:
    """``full`` cut where a target or content span begins or ends, each run of pieces alike one segment
    (both lists are in order and do not overlap: one pass finds each piece's spans)."""
    cuts = sorted({0, len(full), *(p for span in targets for p in span), *(p for s in contents for p in s)})
    kinds = []
    t = c = 0
    for start in cuts[:-1]:
        while t < len(targets) and targets[t][1] <= start:
            t += 1
        while c < len(contents) and contents[c][1] <= start:
            c += 1
        in_target = t < len(targets) and targets[t][0] <= start
        kinds.append((in_target, not (c < len(contents) and contents[c][0] <= start)))
    return runs([full[a:b] for a, b in itertools.pairwise(cuts)], kinds)


_Key = tuple[tuple[tuple[str, str | None], ...], ...]


def _plan_key(messages: list[dict[str, Any]]) -> _Key | None:
    """The shape of ``messages`` for a plan: each message's keys and values, None for every content
    (a plan fills in empty ones too); None when a value is not a string (``1`` and ``True`` are equal keys
    but render differently)."""
    key = []
    for message in messages:
        shape = []
        for k, v in message.items():
            if not (isinstance(k, str) and isinstance(v, str)):
                return None
            shape.append((k, None if k == "content" else v))
        key.append(tuple(shape))
    return tuple(key)


@functools.lru_cache(maxsize=1024)
def _plan_of(template: ChatTemplate, key: _Key) -> Plan | None:
    """The plan of the conversations of shape ``key``, for a template that only prints contents."""
    return plan(
        [{k: "-" if v is None else v for k, v in message} for message in key],  # each content a placeholder
        lambda messages, prompt: template.render(messages, add_generation_prompt=prompt),
        last_only=template.turns == "last",
    )


@functools.lru_cache(maxsize=8)
def _proof(source: str) -> Proof:
    """Whether the template ``source`` is proven to only print the messages' contents."""
    return content_only_printed(source, _compiled(source).environment)


def _any_blank(messages: list[dict[str, Any]]) -> bool:
    return any(not content or content.isspace() for content in (m["content"] for m in messages))


def load_chat_template(
    tokenizer: Tokenizer, field: str, *, turns: ChatTurns = "all", reasoning: ChatReasoning = "train"
) -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer: ``chat_template.jinja`` beside its ``tokenizer.json``,
    else the ``chat_template`` of its ``tokenizer_config.json`` (a string, or the one named ``default``).

    Raises:
        TokenizerError: there is no such template, or it does not parse.
        MissingDependencyError: jinja2 is not installed.
    """
    config_path: Path | None = getattr(tokenizer, "config_path", None)
    if config_path is None:
        raise TokenizerError(
            f"chat={field!r} needs a chat template, which only a Hugging Face tokenizer.json has, with a "
            "tokenizer_config.json (or chat_template.jinja) beside it; tokenizer "
            f"{tokenizer.spec!r} has none. Render the conversations yourself and build with fields=[...]"
        )
    config: dict[str, Any] = getattr(tokenizer, "config", {})
    jinja_file = config_path.with_name("chat_template.jinja")
    source: str | None = None
    if jinja_file.is_file():
        source, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    else:
        source, origin = _config_template(config.get("chat_template")), str(config_path)
    if source is None:
        raise TokenizerError(
            f"chat={field!r} needs a chat template: {config_path} holds no chat_template (and there is no "
            f"{jinja_file.name} beside it); add one, or render the conversations yourself and build with "
            "fields=[...]"
        )
    config_token = getattr(tokenizer, "config_token")  # noqa: B009 (a Hugging Face tokenizer's, as config_path)
    variables = tuple((name, token) for name in TEMPLATE_TOKENS if (token := config_token(name)) is not None)
    template = ChatTemplate(field, source, origin, variables, turns, reasoning)
    _compile_checked(template)
    return template


def _compile_checked(template: ChatTemplate) -> None:
    import jinja2

    try:
        _compiled(template.source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(
            f"{template.origin}: the chat template does not parse (line {e.lineno}: {e.message})"
        ) from None


def _config_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Template:
    """The template compiled in a sandbox as transformers compiles it (once per process and template)."""
    with extra_needed("a chat build", "jinja2 to render its chat template", "chat"):
        import jinja2
        import jinja2.ext
        import jinja2.runtime
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}``, which marks assistant text for transformers' own mask: a plain block here."""

        tags = {"generation"}  # noqa: RUF012 - jinja2 declares it so

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    plain = (str, dict, list, jinja2.utils.Namespace, jinja2.runtime.LoopContext)
    known: dict[tuple[type, str], bool] = {}  # (the attributes a template reads: a handful)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with its checks of a plain str, dict, list, namespace or loop made once per type
        and attribute: they depend on nothing else (the same answers; renders three times as fast)."""

        def getattr(self, obj: Any, attribute: str) -> Any:
            kind: type = type(obj)
            if kind is dict and attribute not in _DICT_ATTRIBUTES:  # ``message.role``: no such attribute
                return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
            if known.get((kind, attribute)) and attribute not in ("format", "format_map"):
                try:  # (a safe attribute, which the sandbox hands over as it is)
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
            return super().getattr(obj, attribute)

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            kind: type = type(obj)
            if kind not in plain:
                return super().is_safe_attribute(obj, attr, value)
            safe = known.get((kind, attr))
            if safe is None:
                safe = known[kind, attr] = super().is_safe_attribute(obj, attr, value)
            return safe

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])

    def strftime_now(format: str) -> str:
        return CHAT_DATE.strftime(format)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    # a ChainMap over the environment's, which each render copies key by key: half of a short render
    template.globals = dict(template.globals)
    return template


_DICT_ATTRIBUTES = frozenset(dir(dict))


@functools.lru_cache(maxsize=8)
def _instrumented(source: str) -> Template:
    """The template, compiled with each loop that prints its items' fields first printing the item's turn
    marker (``item[_TURN_KEY]``: a message's, which :func:`_turn_marks` gives it; nothing for other
    items): a render then says where each message's turn starts."""
    from jinja2 import nodes

    environment = _compiled(source).environment
    tree = environment.parse(source)
    for loop in tree.find_all(nodes.For):
        prints = any(
            not isinstance(node, nodes.TemplateData)
            for out in loop.find_all(nodes.Output)
            for node in out.nodes
        )
        if prints and isinstance(loop.target, nodes.Name):
            item = nodes.Name(loop.target.name, "load")
            loop.body.insert(0, nodes.Output([nodes.Getitem(item, nodes.Const(_TURN_KEY), "load")]))
    template = environment.from_string(tree)
    template.globals = dict(template.globals)
    return template
