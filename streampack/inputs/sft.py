"""Supervised fine-tuning documents: segments of text, each tokenized on its own, each a target or not.

Fields (``fields=["prompt", "response"]``): the last field is the target. Chat (``chat="messages"``): the
conversation is rendered as ``transformers`` renders it (without ``strftime_now``, so that a cache never
depends on the day), and the assistant turns are the targets, found by rendering prefixes: the render of
``messages[:i]`` with the generation prompt must be a prefix of the whole, and that of ``messages[:i + 1]``
ends after turn ``i``. Special-token strings the template writes become their ids; the contents stay text,
told apart by rendering the conversation's shape with each content replaced by a marker. Where the template
is proven to only print the contents (:mod:`~streampack.inputs.chat_proof`), conversations are not rendered
at all but filled into a plan made once per shape (:mod:`~streampack.inputs.chat_plan`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streampack.errors import MissingDependencyError, TokenizerError
from streampack.inputs.chat_plan import MARKER, Plan, marked, plan
from streampack.inputs.chat_proof import Proof, content_only_printed
from streampack.inputs.segments import Segment, Sft

if TYPE_CHECKING:
    from jinja2 import Template

    from streampack.tokenizer.base import Tokenizer

# The special-token strings of a tokenizer_config.json that transformers passes to a template.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatError(ValueError):
    """A conversation that the chat template cannot render, or whose turns cannot be traced."""


def field_segments(values: list[str]) -> Sft:
    """The segments of a record's field values: all prompt, but the last, which is the target."""
    last = len(values) - 1
    return tuple(Segment(value, i == last) for i, value in enumerate(values))


def check_messages(messages: Any, field: str) -> list[dict[str, Any]]:
    """``messages`` if it is a list of ``{role, content}`` objects with string values.

    Raises:
        ChatError: saying what is wrong with it.
    """
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else _kind(messages)
        raise ChatError(f"the {field!r} field is {what}, expected a list of {{role, content}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"{field}[{i}] is {_kind(message)}, expected an object with role and content")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                found = "missing" if key not in message else _kind(message[key])
                raise ChatError(f"{field}[{i}].{key} is {found}, expected a string")
    return messages


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the variables it is rendered with (picklable: workers compile it).

    Attributes:
        field: the record field that holds the messages.
        source: the Jinja source of the template.
        origin: the file it was read from.
        variables: the config's special-token strings (``bos_token``, ...), as (name, value) pairs.
    """

    field: str
    source: str
    origin: str
    variables: tuple[tuple[str, str], ...] = ()

    @property
    def sha256(self) -> str:
        """Hash of the template and its variables: what the manifest records of it."""
        text = json.dumps([self.source, list(self.variables)], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``.

        Raises:
            ChatError: the template refused them (``raise_exception``) or failed on them.
        """
        import jinja2

        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **dict(self.variables)
            )
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template of {self.origin} refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            # (RecursionError: a value nested too deeply for the template's tojson, say)
            raise ChatError(
                f"the chat template of {self.origin} failed on the conversation ({type(e).__name__}: {e})"
            ) from None

    def segments(self, messages: list[dict[str, Any]]) -> Sft:
        """The conversation as segments: template text and contents, the assistant turns as targets.

        Raises:
            ChatError: the template cannot render the conversation, does not render it incrementally, or
                changes the messages' content in a way that cannot be traced.
        """
        proof = _proof(self.source)
        proven = proof.unproven is None and not (proof.needs_non_blank and _any_blank(messages))
        key = _skeleton_key(messages) if proven else None
        shape_plan = None if key is None else _plan_of(self, key)
        if shape_plan is not None:
            return shape_plan.segments(messages)
        full = self.render(messages)
        return _runs(full, self._assistant_spans(messages, full), self._content_spans(messages, full))

    def _assistant_spans(self, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int]]:
        """Where each assistant turn lies in ``full``: from the generation prompt before it to its end."""
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            # A render depends on its arguments alone: the render through the last turn is the whole one.
            through = full if i == len(messages) - 1 else self.render(messages[: i + 1])
            start = spans[-1][1] if spans else 0
            if not (
                full.startswith(before) and full.startswith(through) and start <= len(before) <= len(through)
            ):
                raise ChatError(
                    f"the chat template of {self.origin} does not render the conversation incrementally: the "
                    f"render of its first {i} messages (with the generation prompt) or first {i + 1} is not "
                    f"a prefix of the whole, so assistant turn {i} cannot be found; such templates (e.g. "
                    "ones that drop earlier turns' reasoning) are not supported"
                )
            spans.append((len(before), len(through)))
        return spans

    def _skeleton(self, messages: list[dict[str, Any]]) -> tuple[str, ...]:
        """The render of ``messages`` with each content a marker, split at the markers (text, index, ...),
        made once per shape (the messages' roles and other fields)."""
        key = _skeleton_key(messages)
        return self._render_skeleton(messages) if key is None else _skeleton_of(self, key)

    def _render_skeleton(self, messages: list[dict[str, Any]]) -> tuple[str, ...]:
        return tuple(MARKER.split(self.render(marked(messages))))

    def _content_spans(self, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int]]:
        """Where the messages' contents lie in ``full``: the skeleton with each marker replaced by its
        content, as given or stripped (``| trim``)."""
        parts = self._skeleton(messages)
        spans: list[tuple[int, int]] = []
        at = 0
        for k in range(0, len(parts) - 1, 2):
            text, index, after = parts[k], int(parts[k + 1]), parts[k + 2]
            if not full.startswith(text, at) or index >= len(messages):
                break  # (an index past the messages: a marker in another field of a message)
            at += len(text)
            content = messages[index]["content"]
            found = next(
                (
                    v
                    for v in (content, content.strip())
                    if full.startswith(v, at) and full.startswith(after, at + len(v))
                ),
                None,
            )
            if found is None:
                raise ChatError(
                    f"the chat template of {self.origin} changes the content of message {index} (other than "
                    "by stripping it), so its special-token strings cannot be kept as text"
                )
            spans.append((at, at + len(found)))
            at += len(found)
        if at + len(parts[-1]) != len(full) or not full.endswith(parts[-1]):
            raise ChatError(
                f"the chat template of {self.origin} renders the conversation differently when the contents "
                "change, so its own text cannot be told from the contents"
            )
        return spans


def _runs(full: str, targets: list[tuple[int, int]], contents: list[tuple[int, int]]) -> Sft:
    """``full`` cut where a target or content span begins or ends, each run of pieces alike one segment
    (both lists are in order and do not overlap: one pass finds each piece's spans)."""
    cuts = sorted({0, len(full), *(p for span in targets for p in span), *(p for s in contents for p in s)})
    segments: list[Segment] = []
    t = c = 0
    run_start, run_kind = 0, (False, False)
    for start in cuts[:-1]:
        while t < len(targets) and targets[t][1] <= start:
            t += 1
        while c < len(contents) and contents[c][1] <= start:
            c += 1
        kind = (
            t < len(targets) and targets[t][0] <= start,
            not (c < len(contents) and contents[c][0] <= start),
        )
        if kind != run_kind and start:
            segments.append(Segment(full[run_start:start], *run_kind))
            run_start = start
        run_kind = kind
    if full:
        segments.append(Segment(full[run_start:], *run_kind))
    return tuple(segments)


def _skeleton_key(messages: list[dict[str, Any]]) -> tuple[tuple[tuple[str, str | None], ...], ...] | None:
    """The shape of ``messages``: each message's keys and values but the content; None when one is not a
    string (``1`` and ``True`` are equal keys but render differently)."""
    key = []
    for message in messages:
        shape = []
        for k, v in message.items():
            if k == "content":
                v = None
            elif not (isinstance(k, str) and isinstance(v, str)):
                return None
            shape.append((k, v))
        key.append(tuple(shape))
    return tuple(key)


@functools.lru_cache(maxsize=1024)
def _skeleton_of(
    template: ChatTemplate, key: tuple[tuple[tuple[str, str | None], ...], ...]
) -> tuple[str, ...]:
    """:meth:`ChatTemplate._skeleton` of the conversations whose :func:`_skeleton_key` is ``key``."""
    return template._render_skeleton([{k: v or "" for k, v in message} for message in key])


@functools.lru_cache(maxsize=1024)
def _plan_of(template: ChatTemplate, key: tuple[tuple[tuple[str, str | None], ...], ...]) -> Plan | None:
    """The plan of the conversations of shape ``key``, for a template that only prints contents."""
    shape = [{k: v or "" for k, v in message} for message in key]
    return plan(shape, lambda messages, prompt: template.render(messages, add_generation_prompt=prompt))


@functools.lru_cache(maxsize=8)
def _proof(source: str) -> Proof:
    """Whether the template ``source`` is proven to only print the messages' contents."""
    return content_only_printed(source, _compiled(source).environment)


def _any_blank(messages: list[dict[str, Any]]) -> bool:
    return any(not content or content.isspace() for content in (m["content"] for m in messages))


def load_chat_template(tokenizer: Tokenizer, field: str) -> ChatTemplate:
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
    variables = tuple(
        (name, token) for name in TEMPLATE_TOKENS if (token := _token(config, name)) is not None
    )
    template = ChatTemplate(field, source, origin, variables)
    _compile_checked(template)
    return template


def _config_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _token(config: dict[str, Any], name: str) -> str | None:
    token = config.get(name)
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def _compile_checked(template: ChatTemplate) -> None:
    import jinja2

    try:
        _compiled(template.source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(
            f"{template.origin}: the chat template does not parse (line {e.lineno}: {e.message})"
        ) from None


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Template:
    """The template compiled in a sandbox as transformers compiles it (once per process and template)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise MissingDependencyError(
            "chat builds render chat templates with jinja2: pip install 'streampack[chat]'"
        ) from None

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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    # a ChainMap over the environment's, which each render copies key by key: half of a short render
    template.globals = dict(template.globals)
    return template
