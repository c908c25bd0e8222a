"""SFT builds: records with several fields or a chat become documents with a loss mask beside each shard
(1 on the response / assistant turns and the EOS, 0 on the prompt, template text and BOS)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import streampack
from streampack.errors import (
    BadRecordError,
    CacheError,
    ConfigMismatchError,
    InputError,
    OptionsError,
    TokenizerError,
)
from streampack.format import with_checksum
from streampack.samples import PackedSequences
from streampack.store.files import file_checksum
from tests.conftest import run_cli, set_shard_checksum, write_jsonl

GPT2_EOS = 50256

# ChatML, as Qwen and others write it: each message between <|im_start|>ROLE\n and <|im_end|>\n.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's shape: BOS first, headers, contents trimmed, <|eot_id|> after each turn.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say <|im_end|> and <|eot_id|>, please."},  # text is text
    {"role": "assistant", "content": "<|im_end|> and <|eot_id|>."},
    {"role": "user", "content": "  Thanks!  "},
    {"role": "assistant", "content": "Welcome. "},
]


def encoder(tokenizer_json: Path, *, parse: bool) -> Tokenizer:
    """The tokenizer called directly: special-token strings as their ids (``parse``) or as text."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = not parse
    return tok


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids if text else []


def chat_tokenizer(gpt2: Path, folder: Path, template: str, added: list[str], **config: object) -> Path:
    """GPT-2 with the template's special tokens added, and a tokenizer_config.json holding the template."""
    tok = Tokenizer.from_file(str(gpt2))
    tok.add_special_tokens(added)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **config}))
    return folder / "tokenizer.json"


def docs_and_masks(out: Path) -> list[tuple[list[int], list[int]]]:
    cache = streampack.open(out)
    return [(cache.doc(i).tolist(), cache.doc_loss_mask(i).tolist()) for i in range(cache.num_docs)]


# ------------------------------------------------------------------------------------------------- fields

field_texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.tuples(field_texts, field_texts, field_texts), min_size=1, max_size=12))
def test_the_mask_is_0_on_the_prompt_and_1_on_the_response_and_eos(
    gpt2_tokenizer: Path, records: list[tuple[str, str, str]]
) -> None:
    """Property: each field tokenized on its own by the real tokenizer, concatenated; mask 0 on every field
    but the last, 1 on the last and the EOS; records whose fields are all empty or whitespace left out."""
    tok = encoder(gpt2_tokenizer, parse=False)
    expected = []
    for fields in records:
        if all(not f or f.isspace() for f in fields):
            continue
        prompt = ids(tok, fields[0]) + ids(tok, fields[1])
        response = ids(tok, fields[2])
        expected.append((prompt + response + [GPT2_EOS], [0] * len(prompt) + [1] * (len(response) + 1)))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [{"system": a, "prompt": b, "response": c} for a, b, c in records]
        src = write_jsonl(Path(tmp) / "in.jsonl", rows)
        out = Path(tmp) / "c"
        summary = streampack.build(
            src, out, tokenizer=str(gpt2_tokenizer), fields=["system", "prompt", "response"], workers=1
        )
        assert docs_and_masks(out) == expected
        assert summary.empty_docs == len(records) - len(expected)
        assert streampack.verify(out).ok


@pytest.mark.parametrize("batch_chars", [1 << 20, 2_500, 600])
def test_long_fields_are_cut_into_pieces_that_keep_their_mask_and_one_bos(
    tmp_path: Path, gpt2_tokenizer: Path, batch_chars: int
) -> None:
    tok = encoder(gpt2_tokenizer, parse=False)
    words = ["alpha", "beta", "gamma", "δέλτα", "🙂", "tokens"]
    long = " ".join(words[i % len(words)] + str(i % 5) for i in range(3_000))
    records = [(long[:9_000], long), ("short", "answer"), (long[:1_999], " ok")]
    src = write_jsonl(tmp_path / "in.jsonl", [{"q": q, "a": a} for q, a in records])
    streampack.build(
        src,
        tmp_path / "c",
        tokenizer=str(gpt2_tokenizer),
        fields=["q", "a"],
        bos_id=GPT2_EOS,
        max_piece_chars=1_000,
        batch_chars=batch_chars,
    )
    expected = []
    for q, a in records:
        prompt, response = ids(tok, q), ids(tok, a)
        tokens = [GPT2_EOS, *prompt, *response, GPT2_EOS]
        expected.append((tokens, [0] * (1 + len(prompt)) + [1] * (len(response) + 1)))
    assert docs_and_masks(tmp_path / "c") == expected
    assert streampack.verify(tmp_path / "c").ok


def test_bad_field_records_name_file_and_line_and_can_be_skipped(tmp_path: Path) -> None:
    rows: list[object] = [
        {"prompt": "a", "response": "b"},
        {"prompt": "c"},
        {"prompt": "d", "response": None},
        {"prompt": ["e"], "response": "f"},
        "not an object",
        {"prompt": "g", "response": "h"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(BadRecordError, match=r"in\.jsonl:2: no 'response' field \(fields: 'prompt'\)"):
        streampack.build(src, tmp_path / "c", fields=["prompt", "response"])
    summary = streampack.build(
        src, tmp_path / "c", fields=["prompt", "response"], on_bad_record="skip", overwrite=True
    )
    assert (summary.num_docs, summary.skipped_records) == (2, 4)
    assert docs_and_masks(tmp_path / "c") == [([97, 98, 256], [0, 1, 1]), ([103, 104, 256], [0, 1, 1])]
    with pytest.raises(BadRecordError, match=r"python record 1: the 'response' field is null"):
        streampack.build(
            [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": None}],
            tmp_path / "p",
            fields=["prompt", "response"],
        )
    with pytest.raises(BadRecordError, match=r"python record 0: the record is a str, expected a dict with"):
        streampack.build(streampack.Documents(["text"]), tmp_path / "q", fields=["prompt", "response"])


def test_parquet_and_nested_fields(tmp_path: Path) -> None:
    table = pa.table({"q": ["one", "two", None], "meta": [{"a": "x"}, {"a": "y"}, {"a": "z"}]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=2)
    summary = streampack.build(
        tmp_path / "in.parquet", tmp_path / "c", fields=["q", "meta.a"], on_bad_record="skip"
    )
    assert summary.skipped_records == 1
    assert docs_and_masks(tmp_path / "c") == [
        ([111, 110, 101, 120, 256], [0, 0, 0, 1, 1]),
        ([116, 119, 111, 121, 256], [0, 0, 0, 1, 1]),
    ]
    with pytest.raises(InputError, match=r"in\.parquet: no column 'answer' \(columns: q, meta\)"):
        streampack.build(tmp_path / "in.parquet", tmp_path / "d", fields=["q", "answer"])


def test_text_files_and_contradictory_options_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("just text")
    with pytest.raises(
        InputError, match=r"a\.txt: a text file holds no fields to build with fields=\[\.\.\.\]"
    ):
        streampack.build(tmp_path / "a.txt", tmp_path / "c", fields=["prompt", "response"])
    with pytest.raises(OptionsError, match="give one or the other"):
        streampack.build(tmp_path / "a.txt", tmp_path / "c", fields=["a", "b"], chat="messages")
    with pytest.raises(OptionsError, match="fields must be a list of distinct"):
        streampack.build(tmp_path / "a.txt", tmp_path / "c", fields="prompt,response")


# --------------------------------------------------------------------------------------------------- chat


def expected_chat(tokenizer_json: Path, template: str, messages: list[dict[str, str]]) -> tuple[list, list]:
    """The ChatML document built by hand: template text parsed, contents as text, loss on each assistant
    content and the <|im_end|>\\n after it, and on the EOS."""
    assert template == CHATML
    parse, text = encoder(tokenizer_json, parse=True), encoder(tokenizer_json, parse=False)
    tokens: list[int] = []
    mask: list[int] = []
    for m in messages:
        head, body, tail = (
            ids(parse, f"<|im_start|>{m['role']}\n"),
            ids(text, m["content"]),
            ids(parse, "<|im_end|>\n"),
        )
        target = int(m["role"] == "assistant")
        tokens += head + body + tail
        mask += [0] * len(head) + [target] * (len(body) + len(tail))
    eos = parse.token_to_id("<|endoftext|>")
    return [*tokens, eos], [*mask, 1]


def test_chat_loss_is_on_the_assistant_turns_and_content_stays_text(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    tokenizer = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
    conversations = [CONVERSATION, CONVERSATION[1:3], [{"role": "user", "content": "no answer"}]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": c} for c in conversations])
    streampack.build(src, tmp_path / "c", tokenizer=str(tokenizer.parent), chat="messages")
    got = docs_and_masks(tmp_path / "c")
    assert got == [expected_chat(tokenizer, CHATML, c) for c in conversations]
    im_end = encoder(tokenizer, parse=True).token_to_id("<|im_end|>")
    assert got[0][0].count(im_end) == len(CONVERSATION)  # the template's, not the contents' strings
    cache = streampack.open(tmp_path / "c")
    assert (
        cache.manifest.settings.chat == "messages"
        and cache.manifest.tokenizer.chat_template_sha256 is not None
    )
    assert streampack.verify(tmp_path / "c").ok


@pytest.mark.slow
def test_conversations_of_one_shape_keep_their_own_contents_and_fields(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    """Conversations of one shape share a render of the template with markers for contents, and a
    template's text is encoded once: neither may carry one record's contents or fields into another's."""
    tokenizer = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
    conversations = [
        [{"role": "user", "content": f"question {i} <|im_end|>"}, {"role": "assistant", "content": f"{i}"}]
        for i in range(30)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": c} for c in conversations])
    streampack.build(src, tmp_path / "c", tokenizer=str(tokenizer.parent), chat="messages", batch_chars=100)
    assert docs_and_masks(tmp_path / "c") == [expected_chat(tokenizer, CHATML, c) for c in conversations]

    # Fields beside role and content: 1, True and "1" are equal keys in Python and render differently.
    shown = "{% for m in messages %}{{ m['role'] }} {{ m['weight'] }}: {{ m['content'] }}\n{% endfor %}"
    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok2", shown, CHATML_TOKENS).parent
    weights: list[object] = [1, True, "1", 1.0, "True", 1, [1], "x" * 300]
    records = [{"messages": [{"role": "user", "content": "w", "weight": w}]} for w in weights]
    src = write_jsonl(tmp_path / "w.jsonl", records)
    streampack.build(src, tmp_path / "w", tokenizer=str(folder), chat="messages")
    cache = streampack.open(tmp_path / "w")
    text = encoder(tokenizer, parse=True)
    rendered = [text.decode(cache.doc(i).tolist()[:-1]) for i in range(cache.num_docs)]
    assert rendered == [f"user {w}: w\n" for w in weights]


def test_a_templates_texts_are_encoded_once_each(gpt2_tokenizer: Path) -> None:
    from streampack.tokenizer.base import RecurringTexts

    tok = encoder(gpt2_tokenizer, parse=True)
    asked: list[str] = []

    def encode(texts: list[str]) -> list[np.ndarray]:
        asked.extend(texts)
        return [np.array(e.ids, dtype=np.uint32) for e in tok.encode_batch(texts, add_special_tokens=False)]

    recurring = RecurringTexts(encode)
    long = "<|endoftext|> long " * 20  # over MAX_CHARS: encoded whenever it comes
    batches = [["a<|endoftext|>", "b", "a<|endoftext|>", long], ["b", long, "c"], ["c", "a<|endoftext|>"]]
    for batch in batches:
        got = recurring(batch)
        assert [g.tolist() for g in got] == [ids(tok, t) for t in batch]
        assert not any(g.flags.writeable for g in got)
    assert asked == ["a<|endoftext|>", "b", long, long, "c"]


@pytest.mark.slow
def test_the_render_is_what_transformers_renders(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    transformers = pytest.importorskip("transformers")
    for name, template, added in (("chatml", CHATML, CHATML_TOKENS), ("llama3", LLAMA3, LLAMA3_TOKENS)):
        folder = tmp_path / name
        tokenizer = chat_tokenizer(gpt2_tokenizer, folder, template, added, bos_token=added[0])
        reference = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer), chat_template=template, bos_token=added[0]
        )
        rendered = reference.apply_chat_template(CONVERSATION, tokenize=False)
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": CONVERSATION}])
        streampack.build(src, tmp_path / f"{name}-c", tokenizer=str(folder), chat="messages", eos=False)
        ((tokens, mask),) = docs_and_masks(tmp_path / f"{name}-c")
        decoded = encoder(tokenizer, parse=True).decode(tokens, skip_special_tokens=False)
        assert decoded == rendered
        targets = "".join(  # the text of the loss tokens: the assistant contents and what follows them
            encoder(tokenizer, parse=True).decode([t], skip_special_tokens=False)
            for t, m in zip(tokens, mask)
            if m
        )
        if name == "llama3":  # contents trimmed by the template: traced as stripped, the BOS not a target
            assert (
                tokens[0] == encoder(tokenizer, parse=True).token_to_id("<|begin_of_text|>") and mask[0] == 0
            )
            assert targets == "<|im_end|> and <|eot_id|>.<|eot_id|>Welcome.<|eot_id|>"
        else:
            assert targets == "<|im_end|> and <|eot_id|>.<|im_end|>\nWelcome. <|im_end|>\n"


@pytest.mark.parametrize(
    ("template", "messages", "problem"),
    [
        (CHATML, "not a list", r"the 'messages' field is str, expected a list of \{role, content\}"),
        (CHATML, [{"role": "user"}], r"messages\[0\]\.content is missing, expected a string"),
        (CHATML, [{"role": "user", "content": 3}], r"messages\[0\]\.content is int, expected a string"),
        (
            "{% if messages[0]['role'] != 'user' %}"
            "{{ raise_exception('the first message must be the user') }}{% endif %}" + CHATML,
            [{"role": "assistant", "content": "hi"}],
            "refused the conversation: the first message must be the user",
        ),
        (
            "{% if messages | length > 2 %}{{ messages | length }}{% endif %}"
            + CHATML.replace("message['role']", "(message['role'] if messages | length < 3 else 'bot')"),
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "assistant turn 1 does not start with the generation prompt",
        ),
        (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}",
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "changes the content of message 0",
        ),
        (CHATML, [{"role": "user\ue0009\ue001", "content": "a"}], "renders the conversation differently"),
    ],
    ids=[
        "not a list",
        "no content",
        "content not a string",
        "raise_exception",
        "not incremental",
        "upper",
        "a marker in a role",
    ],
)
def test_bad_conversations_are_bad_records(
    tmp_path: Path, gpt2_tokenizer: Path, template: str, messages: object, problem: str
) -> None:
    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", template, CHATML_TOKENS).parent
    good = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    src = write_jsonl(tmp_path / "in.jsonl", [good, {"messages": messages}, good])
    with pytest.raises(BadRecordError, match=r"in\.jsonl:2: .*" + problem):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    summary = streampack.build(
        src, tmp_path / "c", tokenizer=str(folder), chat="messages", on_bad_record="skip", overwrite=True
    )
    assert (summary.num_docs, summary.skipped_records) == (2, 1)


def test_a_conversation_too_deep_for_the_template_is_a_bad_record(
    tmp_path: Path, gpt2_tokenizer: Path, request: pytest.FixtureRequest
) -> None:
    """A template that writes a message as JSON fails on one nested deeper than Python's recursion limit
    (orjson read it: it is within 1024 levels): a bad record, not a traceback that stops the build."""
    template = "{% for m in messages %}{{ m | tojson }}{% endfor %}"
    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", template, CHATML_TOKENS).parent
    # Python's default limit (1000), whatever a library imported earlier in the session raised it to.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    request.addfinalizer(lambda: sys.setrecursionlimit(limit))
    good = json.dumps({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})
    deep = '{"messages": [{"role": "user", "content": "Q", "meta": ' + "[" * 1000 + "]" * 1000 + "}]}"
    src = tmp_path / "in.jsonl"
    src.write_text(f"{good}\n{deep}\n{good}\n")
    with pytest.raises(
        BadRecordError, match=r"in\.jsonl:2: the chat template .* failed on the conversation \(Rec"
    ):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    summary = streampack.build(
        src, tmp_path / "c", tokenizer=str(folder), chat="messages", on_bad_record="skip", overwrite=True
    )
    assert (summary.num_docs, summary.skipped_records) == (2, 1)


@pytest.mark.slow
def test_no_chat_template_is_a_clear_error(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": []}])
    with pytest.raises(
        TokenizerError, match=r"needs a chat template: .*tokenizer_config\.json holds no chat_template"
    ):
        folder = tmp_path / "tok"
        folder.mkdir()
        shutil.copy(gpt2_tokenizer, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text("{}")
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    with pytest.raises(TokenizerError, match=r"only a Hugging Face tokenizer\.json has"):
        streampack.build(src, tmp_path / "c", chat="messages")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="the chat template does not parse"):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    (folder / "chat_template.jinja").write_text(CHATML)  # as transformers saves it: preferred
    tok = Tokenizer.from_file(str(gpt2_tokenizer))
    tok.add_special_tokens(CHATML_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATION}])
    streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    assert docs_and_masks(tmp_path / "c") == [expected_chat(folder / "tokenizer.json", CHATML, CONVERSATION)]


def test_a_changed_template_is_refused_on_resume(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS).parent
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": CONVERSATION}])
    streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML + "\n"}))
    with pytest.raises(ConfigMismatchError, match="tokenizer: the cache has"):
        streampack.build(src, tmp_path / "c", tokenizer=str(folder), chat="messages")


# -------------------------------------------------------------------------------------- storage and reading


def test_plain_caches_have_no_mask(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    streampack.build(src, tmp_path / "c")
    cache = streampack.open(tmp_path / "c")
    assert not cache.has_loss_mask and not list((tmp_path / "c" / "shards").glob("*.mask"))
    with pytest.raises(CacheError, match="the cache has no loss mask"):
        cache.shard_loss_mask(0)
    with pytest.raises(CacheError, match="the cache has no loss mask"):
        cache.doc_loss_mask(0)


def test_mask_files_sit_beside_the_shards_and_are_recorded(tmp_path: Path) -> None:
    rows = [{"p": f"prompt {i}", "r": f"response {i}" * (i % 9)} for i in range(3_000)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    streampack.build(src, tmp_path / "c", fields=["p", "r"], unit_bytes=1 << 16, workers=2)
    cache = streampack.open(tmp_path / "c")
    assert cache.has_loss_mask and cache.num_shards > 1 and cache.manifest.loss_mask
    for shard, info in enumerate(cache.shards):
        path = tmp_path / "c" / "shards" / f"{info.name}.mask"
        assert path.stat().st_size == info.num_tokens and info.mask_checksum == file_checksum(path)
        ledger = json.loads((tmp_path / "c" / "ledger" / f"{info.name}.json").read_text())
        assert ledger["mask_checksum"] == info.mask_checksum
        mask = cache.shard_loss_mask(shard)
        assert mask.dtype == np.uint8 and len(mask) == len(cache.shard_tokens(shard))
    for i in (0, 1, cache.num_docs - 1):
        row = rows[i]
        assert cache.doc(i).tolist() == [*row["p"].encode(), *row["r"].encode(), 256]
        assert cache.doc_loss_mask(i).tolist() == [0] * len(row["p"]) + [1] * (len(row["r"]) + 1)


def damaged(cache: Path, tmp_path: Path, position: int, value: int, *, fix_checksum: bool = True) -> Path:
    copy = tmp_path / f"damaged-{position}-{value}-{fix_checksum}"
    shutil.copytree(cache, copy)
    path = copy / "shards" / "000000.mask"
    data = bytearray(path.read_bytes())
    data[position] = value
    path.write_bytes(bytes(data))
    if fix_checksum:
        manifest = json.loads((copy / "manifest.json").read_text())
        set_shard_checksum(manifest, 0, "mask_crc32", file_checksum(path))
        (copy / "manifest.json").write_text(json.dumps(with_checksum(manifest)))
    return copy


def test_verify_checks_the_mask(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"p": "ab", "r": "cd"}, {"p": "e", "r": "f"}])
    streampack.build(
        src, tmp_path / "c", fields=["p", "r"], bos_id=300, allow_new_ids=True
    )  # [300 a b c d 256] [300 e f 256]
    assert streampack.verify(tmp_path / "c").ok
    problems = streampack.verify(damaged(tmp_path / "c", tmp_path, 2, 1, fix_checksum=False)).problems
    assert any("000000.mask: checksum" in p for p in problems), problems
    problems = streampack.verify(damaged(tmp_path / "c", tmp_path, 2, 7)).problems
    assert any("000000.mask: byte 2 is 7, not 0 or 1" in p for p in problems), problems
    problems = streampack.verify(damaged(tmp_path / "c", tmp_path, 9, 0)).problems
    assert any("the EOS of document 1 (and 0 more) has mask 0, not 1" in p for p in problems), problems
    problems = streampack.verify(damaged(tmp_path / "c", tmp_path, 6, 1)).problems
    assert any("the BOS of document 1 (and 0 more) has mask 1, not 0" in p for p in problems), problems
    short = damaged(tmp_path / "c", tmp_path, 0, 0)
    path = short / "shards" / "000000.mask"
    path.write_bytes(path.read_bytes()[:-1])
    opened = streampack.open(short)  # shard files are checked when first read
    with pytest.raises(CacheError, match=r"000000\.mask: 9 bytes, but the manifest says 10 items"):
        opened.doc_loss_mask(0)
    problems = streampack.verify(short).problems
    assert any("000000.mask: 9 bytes, but the manifest says 10 items" in p for p in problems), problems


def test_resuming_with_other_fields_is_refused(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"p": "a", "r": "b", "s": "c"}])
    streampack.build(src, tmp_path / "c", fields=["p", "r"])
    streampack.build(src, tmp_path / "c", fields=("p", "r"))  # the same fields: reused
    with pytest.raises(
        ConfigMismatchError, match=r"fields: the cache has \['p', 'r'\], this build has \['p', 's'\]"
    ):
        streampack.build(src, tmp_path / "c", fields=["p", "s"])
    with pytest.raises(ConfigMismatchError, match=r"fields: the cache has \['p', 'r'\], this build has None"):
        streampack.build(src, tmp_path / "c", text_field="p")


@pytest.mark.slow
def test_cli_sft_build_info_verify(tmp_path: Path, gpt2_tokenizer: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi", "response": " there"}])
    result = run_cli(
        "build", src, "--tokenizer", gpt2_tokenizer, "--out", tmp_path / "c", "--fields", "prompt,response"
    )
    assert "1 documents" in result.stdout
    info = json.loads(run_cli("info", tmp_path / "c", "--json").stdout)
    assert info["loss_mask"] is True and info["sft"].startswith("fields prompt, response (loss on response")
    assert run_cli("verify", tmp_path / "c").stdout.startswith("ok:")
    assert docs_and_masks(tmp_path / "c") == [([17250, 612, GPT2_EOS], [0, 1, 1])]

    folder = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS).parent
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"conv": CONVERSATION}])
    run_cli("build", chat, "--tokenizer", folder, "--out", tmp_path / "d", "--chat", "conv")
    assert json.loads(run_cli("info", tmp_path / "d", "--json").stdout)["sft"].startswith(
        "chat messages in 'conv'"
    )
    assert run_cli("verify", tmp_path / "d").stdout.startswith("ok:")

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Hi"}])
    failed = run_cli("build", bad, "--out", tmp_path / "e", "--fields", "prompt,response", check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert (
        "bad.jsonl:1: no 'response' field (fields: 'prompt'); pass --fields A,B to choose another"
        in failed.stderr
    )
    failed = run_cli("build", chat, "--out", tmp_path / "f", "--chat", "conv", check=False)
    assert failed.returncode == 1 and "chat='conv' needs a chat template" in failed.stderr


# ------------------------------------------------------------------------------ samples with no target


def all_labels(samples: PackedSequences) -> np.ndarray:
    """The ``output="dict"`` labels of every sample, in order."""
    loader = streampack.Loader(samples, batch_size=1, shuffle=False, epochs=1, output="dict")
    return np.concatenate([batch["labels"] for batch in loader])


@pytest.mark.slow
def test_samples_without_a_target_are_counted_and_can_be_dropped(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    tokenizer = chat_tokenizer(gpt2_tokenizer, tmp_path / "tok", CHATML, CHATML_TOKENS)
    long_prompt = [
        {"role": "user", "content": "Please summarise the following. " + "The cache keeps tokens. " * 30},
        {"role": "assistant", "content": "Tokens are kept."},
    ]
    short = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    unanswered = [{"role": "user", "content": "Anyone there?"}]
    conversations = [short, long_prompt, short, long_prompt, unanswered, long_prompt, short]
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in conversations])
    # Without EOS (the EOS is a target), a conversation without an assistant turn has no target at all.
    run_cli(
        "build",
        src,
        "--tokenizer",
        tokenizer.parent,
        "--out",
        tmp_path / "c",
        "--chat",
        "messages",
        "--no-eos",
    )
    cache = streampack.open(tmp_path / "c")
    seq_len = 48
    assert all(len(cache.doc(i)) > seq_len for i in (1, 3, 5)) and len(cache.doc(0)) < seq_len

    truncated = cache.documents(seq_len)  # the default: too_long="truncate", no_target="keep"
    untrained = [i for i, row in enumerate(all_labels(truncated)) if (row == -100).all()]
    assert untrained == [1, 3, 4, 5]  # the three truncated before their answer, and the unanswered one
    assert truncated.layout.no_target == 4 and truncated.layout.dropped == 0
    assert "dropped=0, no_target=4" in repr(streampack.Loader(truncated, batch_size=2))

    kept = cache.documents(seq_len, no_target="drop")
    assert len(kept) == 3 and kept.layout.no_target == 4
    assert ((all_labels(kept) != -100).any(axis=1)).all()
    assert np.array_equal(kept[np.arange(3)], truncated[np.array([0, 2, 6])])

    too_long_dropped = cache.documents(seq_len, too_long="drop")
    assert (too_long_dropped.layout.dropped, too_long_dropped.layout.no_target) == (3, 1)

    # Split: the pieces of a long conversation that hold only prompt are counted (and dropped) alone.
    split = cache.documents(seq_len, too_long="split")
    split_untrained = int(((all_labels(split) == -100).all(axis=1)).sum())
    assert split.layout.no_target == split_untrained > 1
    answered = cache.documents(seq_len, too_long="split", no_target="drop")
    assert (
        len(answered) == len(split) - split_untrained and ((all_labels(answered) != -100).any(axis=1)).all()
    )
    packed = cache.packed(seq_len, too_long="split", no_target="drop")
    assert packed.layout.no_target == split_untrained and packed.layout.tokens == answered.layout.tokens

    info = json.loads(run_cli("info", tmp_path / "c", "--json").stdout)
    assert info["no_target_docs"] == 1  # whatever the seq_len: the unanswered conversation


def test_prompts_longer_than_seq_len_in_a_fields_cache_are_counted(
    tmp_path: Path, gpt2_tokenizer: Path
) -> None:
    records = [{"prompt": "Question " * n, "response": " answer."} for n in (3, 40, 5, 60)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    streampack.build(src, tmp_path / "c", tokenizer=str(gpt2_tokenizer), fields=["prompt", "response"])
    cache = streampack.open(tmp_path / "c")
    samples = cache.documents(16)
    assert samples.layout.no_target == 2 == int(((all_labels(samples) == -100).all(axis=1)).sum())
    assert len(cache.documents(16, no_target="drop")) == 2
    assert json.loads(run_cli("info", tmp_path / "c", "--json").stdout)["no_target_docs"] == 0  # EOS trains
