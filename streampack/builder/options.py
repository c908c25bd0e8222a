"""The settings of a build: what identifies a cache (:class:`CacheSpec`, recorded and compared on resume)
apart from how a run goes (:class:`RunOptions`, which never change the bytes). The CLI takes its defaults
and choices from here."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict, TypeVar, get_args

from streampack._checks import check_bool, check_choice, check_int, check_int_or_none
from streampack.errors import OptionsError
from streampack.inputs import DEFAULT_UNIT_BYTES
from streampack.inputs.sft import CHAT_REASONING, CHAT_TURNS, ChatReasoning, ChatTurns
from streampack.tokenizer.choices import ENGINE_CHOICES, SPECIAL_TOKENS, SpecialTokens, TokenizerEngine

OnBadRecord = Literal["error", "skip"]
Executor = Literal["local", "ray"]
VerifyTokens = Literal["sample", "all", "none"]
_Options = TypeVar("_Options", bound=type)


def _named_fields(cls: _Options) -> _Options:
    """Make ``cls(**kwargs)`` refuse a misspelt field with an :class:`OptionsError` naming the nearest."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]
    names = {f.name for f in fields(cls)}

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise OptionsError(unknown_option(unknown[0], names, f"{cls.__name__} has no field"))
        init(self, *args, **kwargs)

    setattr(cls, "__init__", checked_init)  # noqa: B010 - mypy refuses assigning a method directly
    return cls


def unknown_option(name: str, names: Collection[str], what: str) -> str:
    """The message for an unknown option ``name``: ``what``, the name, and the nearest of ``names``."""
    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{what} {name!r}{hint} (see CacheSpec and RunOptions)"


@_named_fields
@dataclass(frozen=True)
class CacheSpec:
    """The settings that identify a cache: all recorded in the manifest and compared on resume.

    Attributes:
        tokenizer: tokenizer SPEC: ``bytes``, a ``tokenizer.json`` path or folder, or ``tiktoken:PATH``.
        special_tokens: ``text`` (default): special-token strings in documents are encoded as the text they
            are; ``parse``: as the special tokens' ids.
        eos: append an EOS id after every document.
        eos_id: the EOS id to append (default: the tokenizer's own EOS token).
        bos: put the tokenizer's BOS id before every document (see
            :func:`streampack.tokenizer.specials.resolve_bos`).
        bos_id: put this BOS id before every document (sets ``bos``).
        text_field: JSON key or Parquet column holding the text.
        split_lines: one document per line of ``.txt`` inputs (default: one per file).
        unit_bytes: size of the work units large uncompressed JSONL and Parquet files are split into.
        max_piece_chars: longer documents are tokenized in pieces of at most this many characters
            (default: see :func:`streampack.tokenizer.pieces.piece_rule`).
        fields: an SFT build: each record's fields, in this order, tokenized each on its own; all but the
            last are the prompt, the last (and the EOS) the target (see :mod:`streampack.inputs.sft`).
        chat: an SFT build: the record field holding a list of ``{role, content}`` messages, rendered with
            the chat template beside the tokenizer; the assistant turns (and the EOS) are the target.
        chat_turns: a chat build's targets: ``all`` assistant turns, or the ``last`` one only.
        chat_reasoning: ``train``: an assistant turn's reasoning (``reasoning_content``, ``thinking``), as
            the template prints it, is a target; ``mask``: the turn's target starts after it.
    """

    tokenizer: str = "bytes"
    special_tokens: SpecialTokens = "text"
    eos: bool = True
    eos_id: int | None = None
    bos: bool = False
    bos_id: int | None = None
    text_field: str = "text"
    split_lines: bool = False
    unit_bytes: int = DEFAULT_UNIT_BYTES
    max_piece_chars: int | None = None
    fields: tuple[str, ...] | None = None
    chat: str | None = None
    chat_turns: ChatTurns = "all"
    chat_reasoning: ChatReasoning = "train"

    def __post_init__(self) -> None:
        check_choice("special_tokens", self.special_tokens, SPECIAL_TOKENS)
        for name in ("eos", "bos", "split_lines"):
            check_bool(name, getattr(self, name))  # eos="append" would be truthy, and written as such
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise OptionsError(f"tokenizer must be a non-empty SPEC string (got {self.tokenizer!r})")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise OptionsError(f"text_field must be a non-empty string (got {self.text_field!r})")
        if not self.eos and self.eos_id is not None:
            raise OptionsError(f"eos_id={self.eos_id} contradicts eos=False: give one or the other")
        for name in ("eos_id", "bos_id"):
            object.__setattr__(self, name, check_int_or_none(name, getattr(self, name), min=0, below=2**32))
        if self.bos_id is not None:
            object.__setattr__(self, "bos", True)  # one way to record a BOS id, whichever way it was given
        object.__setattr__(self, "unit_bytes", check_int("unit_bytes", self.unit_bytes, min=1 << 16))
        object.__setattr__(
            self, "max_piece_chars", check_int_or_none("max_piece_chars", self.max_piece_chars, min=1)
        )
        self._check_sft()

    def _check_sft(self) -> None:
        if self.fields is not None:
            names = list(self.fields) if isinstance(self.fields, (list, tuple)) else []
            if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
                raise OptionsError(
                    "fields must be a list of distinct, non-empty field names such as ['prompt', "
                    f"'response'] (got {self.fields!r})"
                )
            object.__setattr__(self, "fields", tuple(names))  # a list given, a tuple kept (hashable)
        if self.chat is not None and (not isinstance(self.chat, str) or not self.chat):
            raise OptionsError(f"chat must be the name of the field holding the messages (got {self.chat!r})")
        if self.fields is not None and self.chat is not None:
            raise OptionsError(f"fields={list(self.fields)} and chat={self.chat!r}: give one or the other")
        check_choice("chat_turns", self.chat_turns, CHAT_TURNS)
        check_choice("chat_reasoning", self.chat_reasoning, CHAT_REASONING)
        if self.chat is None and (self.chat_turns, self.chat_reasoning) != ("all", "train"):
            raise OptionsError(
                f"chat_turns={self.chat_turns!r} and chat_reasoning={self.chat_reasoning!r} choose a chat "
                "build's targets: give chat=FIELD too, or leave them out"
            )

    @property
    def sft(self) -> bool:
        """An SFT build (fields or chat): its shards carry a loss mask."""
        return self.fields is not None or self.chat is not None

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``settings``."""
        settings = dataclasses.asdict(self)
        settings["fields"] = None if self.fields is None else list(self.fields)
        return settings


@_named_fields
@dataclass(frozen=True)
class RunOptions:
    """How a build runs; never changes the cache's bytes, never recorded.

    Attributes:
        workers: worker processes (default: see :func:`streampack.builder.executors.default_workers`).
        threads: tokenizer threads per worker (default: the cores divided among the workers).
        executor: ``local`` (a process pool on this machine) or ``ray`` (Ray tasks on a cluster).
        tokenizer_engine: what computes the token ids: ``auto`` (``fastokens`` where installed and proven
            to give the tokenizer's own ids, else the tokenizer's library), ``tokenizers``, ``tiktoken``,
            ``fastokens`` or ``gigatoken`` (only when named). ``BuildSummary.tokenizer_engine`` says which
            ran and why.
        verify_tokens: with an engine other than the tokenizer's reference engine, re-encode with the
            reference and stop at the first difference: ``sample`` (the build's first 20 records and a
            hash-chosen 0.1 % of the rest), ``all``, or ``none``.
        ray_address: the Ray cluster to connect to (default: a running one, else a new local instance).
        on_bad_record: ``error`` stops at the first bad record; ``skip`` skips and counts them.
        overwrite: delete an existing cache in the output directory and start over.
        progress: show a progress bar on stderr.
        batch_chars: characters of text tokenized per batch call.
        commit_bytes: commit after this many bytes of tokens...
        commit_seconds: ...or after this many seconds, whichever comes first.
        staging_dir: a build to object storage: the local directory where shards are built before they
            are uploaded (default: one per URL under the system temp directory).
        storage_options: a build to object storage: options of its fsspec filesystem (default: from the
            environment).
        profile: measure the CPU time of each part of the pipeline too (``BuildSummary.timings``).
        allow_new_ids: allow an ``eos_id`` or ``bos_id`` outside the tokenizer's vocabulary; the cache's
            ``vocab_size`` then grows past it. It only permits, so it is not part of the cache's identity.
    """

    workers: int | None = None
    threads: int | None = None
    executor: Executor = "local"
    tokenizer_engine: TokenizerEngine = "auto"
    verify_tokens: VerifyTokens = "sample"
    ray_address: str | None = None
    on_bad_record: OnBadRecord = "error"
    overwrite: bool = False
    progress: bool = False
    batch_chars: int = 1 << 20
    commit_bytes: int = 64 << 20
    commit_seconds: float = 10.0
    staging_dir: str | None = None
    storage_options: Mapping[str, Any] | None = None
    profile: bool = False
    allow_new_ids: bool = False

    def __post_init__(self) -> None:
        check_choice("executor", self.executor, get_args(Executor))
        check_choice("tokenizer_engine", self.tokenizer_engine, ENGINE_CHOICES)
        check_choice("verify_tokens", self.verify_tokens, get_args(VerifyTokens))
        check_choice("on_bad_record", self.on_bad_record, get_args(OnBadRecord))
        for name in ("overwrite", "progress", "profile", "allow_new_ids"):
            check_bool(name, getattr(self, name))
        for name in ("workers", "threads"):
            object.__setattr__(self, name, check_int_or_none(name, getattr(self, name), min=1))
        for name in ("batch_chars", "commit_bytes"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), min=1))
        if self.commit_seconds < 0:
            raise OptionsError(f"commit_seconds must be >= 0 (got {self.commit_seconds})")


class BuildKeywords(TypedDict, total=False):
    """The fields of :class:`CacheSpec` and of :class:`RunOptions`, as keywords of ``build()``."""

    tokenizer: str
    special_tokens: SpecialTokens
    eos: bool
    eos_id: int | None
    bos: bool
    bos_id: int | None
    text_field: str
    split_lines: bool
    unit_bytes: int
    max_piece_chars: int | None
    fields: tuple[str, ...] | list[str] | None
    chat: str | None
    chat_turns: ChatTurns
    chat_reasoning: ChatReasoning
    # RunOptions
    workers: int | None
    threads: int | None
    executor: Executor
    tokenizer_engine: TokenizerEngine
    verify_tokens: VerifyTokens
    ray_address: str | None
    on_bad_record: OnBadRecord
    overwrite: bool
    progress: bool
    batch_chars: int
    commit_bytes: int
    commit_seconds: float
    staging_dir: str | None
    storage_options: Mapping[str, Any] | None
    profile: bool
    allow_new_ids: bool


def split_options(
    spec: CacheSpec | None, run: RunOptions | None, options: Mapping[str, Any]
) -> tuple[CacheSpec, RunOptions]:
    """``spec`` and ``run`` (defaults when None) with the named fields of either replaced by ``options``.

    Raises:
        OptionsError: a name is a field of neither, or a value is not allowed.
    """
    spec_names = {f.name for f in fields(CacheSpec)}
    run_names = {f.name for f in fields(RunOptions)}
    unknown = sorted(set(options) - spec_names - run_names)
    if unknown:
        raise OptionsError(unknown_option(unknown[0], spec_names | run_names, "unknown build option"))
    spec = dataclasses.replace(spec or CacheSpec(), **{k: v for k, v in options.items() if k in spec_names})
    run = dataclasses.replace(run or RunOptions(), **{k: v for k, v in options.items() if k in run_names})
    return spec, run
