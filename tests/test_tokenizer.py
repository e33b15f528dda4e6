"""Tests for TextTokenizer against the real SmolLM2 tokenizer and transformers' own rendering."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import QWEN3_STYLE_TEMPLATE

from benchmarks.tiny_model import TOKENIZER_FILES
from vbatch.client.tokenizer import TextTokenizer, check_template_kwargs
from vbatch.errors import InputError, ModelLoadError
from vbatch.models.loader import ResolvedModel

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Say 'héllo wörld' — 你好 🎉\n  twice."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "<|im_end|> is text here"},
        {"role": "assistant", "content": "ok", "name": None},
    ],
]

# NOTE: exercises the template features transformers provides: bos_token, raise_exception,
# tojson, namespace, loop controls, whitespace control and the generation tag.
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}] {{ message | tojson }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{{ eos_token }}{% endif %}\n"
    "{%- endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@pytest.fixture(scope="session")
def hf_dir(smollm2: ResolvedModel) -> Path:
    return smollm2.hf_dir


@pytest.fixture(scope="session")
def hf_tokenizer(hf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def test_special_tokens_match_transformers(tokenizer: TextTokenizer, hf_tokenizer) -> None:
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    expected = {i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special}
    assert tokenizer.special_token_ids == expected
    assert tokenizer.special_tokens == hf_tokenizer.special_tokens_map
    assert tokenizer.convert_ids_to_tokens([1, 28120, 905]) == hf_tokenizer.convert_ids_to_tokens(
        [1, 28120, 905]
    )


def test_encode_batch_equals_per_text_encode(tokenizer: TextTokenizer, hf_tokenizer) -> None:
    texts = ["", "Hello world", " leading space", "héllo 你好 🎉", "a<|im_start|>b", "x" * 500]
    batch = tokenizer.encode_batch(texts)
    assert batch == [tokenizer.backend.encode(t).ids for t in texts]
    assert batch == [hf_tokenizer.encode(t) for t in texts]
    assert batch[4][1] == 1, "special token text must map to its id"
    # NOTE: SmolLM2 adds no BOS, so special tokens on or off give the same ids here.
    assert tokenizer.encode_batch(texts, add_special_tokens=False) == batch


def test_decode_matches_transformers(tokenizer: TextTokenizer, hf_tokenizer) -> None:
    ids = tokenizer.encode_batch(["<|im_start|>assistant\nHi 🎉 there<|im_end|>"])[0]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(ids) == "assistant\nHi 🎉 there"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: TextTokenizer, hf_tokenizer, conversation: list, add_generation_prompt: bool
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert tokenizer.encode_chats([conversation], add_generation_prompt) == [expected_ids]


def test_chat_template_default_system_prompt(tokenizer: TextTokenizer) -> None:
    with_system = tokenizer.apply_chat_template(CONVERSATIONS[1])
    without_system = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert "You answer in one word." in with_system
    assert "SmolLM" not in with_system
    assert without_system.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert without_system.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_custom_template_features_match_transformers(
    tokenizer: TextTokenizer, hf_tokenizer, conversation: list
) -> None:
    custom = TextTokenizer(tokenizer.backend, tokenizer.special_tokens, CUSTOM_TEMPLATE)
    expected = hf_tokenizer.apply_chat_template(
        conversation, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    rendered = custom.apply_chat_template(conversation)
    assert rendered == expected
    assert rendered.startswith("<|im_start|>[1] {")
    assert "\\u" not in rendered, "tojson must not escape non-ASCII text"


def test_template_raise_exception_is_input_error(tokenizer: TextTokenizer) -> None:
    custom = TextTokenizer(tokenizer.backend, tokenizer.special_tokens, CUSTOM_TEMPLATE)
    with pytest.raises(InputError, match="unknown role tool"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", r"messages must be a non-empty list"),
        ([], r"messages must be a non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"content": "a"}], r"messages\[0\] must have a string 'role'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list"),
        ([{"role": None, "content": "a"}], r"messages\[0\] must have a string 'role'"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"messages\[0\]\.content\[0\] is a 'image_url' part; the model is text-only",
        ),
        ([{"role": "user", "content": [{"text": "a"}]}], r"must be \{'type': 'text'"),
    ],
)
def test_bad_messages_raise_input_error(
    tokenizer: TextTokenizer, messages: object, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_no_chat_template_is_input_error(tokenizer: TextTokenizer) -> None:
    plain = TextTokenizer(tokenizer.backend, tokenizer.special_tokens)
    assert not plain.has_chat_template
    with pytest.raises(InputError, match="no chat template"):
        plain.encode_chats([CONVERSATIONS[0]])


def test_template_from_tokenizer_config_list_form(
    hf_dir: Path, tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {
            "name": "default",
            "template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        },
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = TextTokenizer.from_dir(tmp_path)
    assert loaded.eos_token_id == 0
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|endoftext|>"


def test_special_tokens_map_names_tokens_as_in_transformers(hf_dir: Path, tmp_path: Path) -> None:
    """Older repos name their special tokens in special_tokens_map.json only, or there and
    otherwise in tokenizer_config.json: transformers takes the map's."""
    from transformers import AutoTokenizer

    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special))
    messages = [{"role": "user", "content": "hi"}]
    for config_eos in (None, "<|endoftext|>"):
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps({**config, "eos_token": config_eos})
        )
        loaded = TextTokenizer.from_dir(tmp_path)
        reference = AutoTokenizer.from_pretrained(tmp_path)
        assert loaded.apply_chat_template(messages) == "<|im_start|>hi<|im_end|>"
        assert loaded.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False
        )
        assert loaded.eos_token_id == reference.eos_token_id == 2


def test_named_templates_continued_json_and_reasoning_aliases_as_in_transformers(
    hf_dir: Path, tmp_path: Path
) -> None:
    """A named template list ("tool_use" for tools, a name as chat_template), a
    chat_template.jinja with additional_chat_templates/, a final message continued through
    `tojson`, and reasoning under `reasoning` or `thinking`: each rendered as transformers does
    (vbatch kept only "default", rendered a name as text, lost its NUL-marked tag in `tojson`,
    and passed the fields unaliased; later, rendered the name "default" as text)."""
    from transformers import AutoTokenizer

    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    body = "{% for m in messages %}{{ m.role }}[{{ m.thinking }}]{{ m.content | tojson }}"
    body += "{% endfor %}"
    named = [
        {"name": "default", "template": "DEFAULT:" + body},
        {"name": "tool_use", "template": "TOOLS({{ tools | length }}):" + body},
        {"name": "rag", "template": "RAG:" + body},
    ]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": named}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", files / "tokenizer.json")
    (files / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    (files / "chat_template.jinja").write_text("DEFAULT:" + body)
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS:" + body)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    user = {"role": "user", "content": "hi"}
    cases = [
        ([user], {"tools": tools}, None, False),
        ([user], {}, "rag", False),
        ([user], {}, "default", False),
        ([user], {"tools": tools}, "default", False),
        ([user, {"role": "assistant", "content": "Sure, the"}], {}, None, True),
        ([user, {"role": "assistant", "content": "ans", "reasoning": "thought"}], {}, None, False),
    ]
    for directory in (tmp_path, files):
        ours = TextTokenizer.from_dir(directory)
        theirs = AutoTokenizer.from_pretrained(directory)
        for messages, kwargs, name, cont in cases:
            got = ours.apply_chat_template(
                messages, not cont, kwargs, chat_template=name, continue_final_message=cont
            )
            want = theirs.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not cont,
                chat_template=name,
                continue_final_message=cont,
                **kwargs,
            )
            assert got == want, (directory.name, messages, kwargs, name)
    assert "TOOLS(1):" in TextTokenizer.from_dir(tmp_path).apply_chat_template(
        [user], True, {"tools": tools}
    )


def test_from_dir_errors(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        TextTokenizer.from_dir(tmp_path)
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ModelLoadError, match="does not compile"):
        TextTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_template_kwargs_reach_a_qwen3_template_as_in_transformers(
    tokenizer: TextTokenizer, hf_tokenizer, enable_thinking: bool | None
) -> None:
    qwen3 = TextTokenizer(tokenizer.backend, tokenizer.special_tokens, QWEN3_STYLE_TEMPLATE)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    history = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
        {"role": "user", "content": "2+2?"},
    ]
    expected = hf_tokenizer.apply_chat_template(
        history,
        chat_template=QWEN3_STYLE_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        **kwargs,
    )
    rendered = qwen3.apply_chat_template(history, template_kwargs=kwargs)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (
        enable_thinking is False
    )
    assert "add" not in rendered


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (["enable_thinking"], "must be an object of template variables"),
        ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
        ({"enable thinking": True}, "not a template variable name"),
        ({"chat_template": "X{{ messages }}"}, "may not set 'chat_template': it says how"),
        ({"continue_final_message": True}, "may not set 'continue_final_message'"),
    ],
)
def test_bad_template_kwargs_are_input_errors(kwargs: object, message: str) -> None:
    with pytest.raises(InputError, match=message):
        check_template_kwargs(kwargs)


def test_text_parts_and_a_null_assistant_content_render_as_plain_text(
    tokenizer: TextTokenizer,
) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    plain = [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    openai = [
        {"role": "user", "content": parts, "name": None},
        {"role": "assistant", "content": None, "tool_calls": None},
    ]
    assert tokenizer.apply_chat_template(openai) == tokenizer.apply_chat_template(plain)


TRIMMING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("final", ["The answer is ", "Well,\n", "  spaced  ", "plain", ""])
@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE])
def test_continue_final_message_cuts_where_transformers_does(
    tokenizer: TextTokenizer, hf_tokenizer, final: str, template: str | None
) -> None:
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": final},
    ]
    expected = hf_tokenizer.apply_chat_template(
        conversation,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    got = tokenizer.apply_chat_template(
        conversation, False, chat_template=template, continue_final_message=True
    )
    assert got == expected


def test_a_text_cut_to_its_last_tokens_keeps_the_special_tokens_its_encoding_added(
    tmp_path: Path, smollm2: ResolvedModel
) -> None:
    """As transformers truncates on the left (and vLLM a text prompt): a BERT-style [CLS] ...
    [SEP] encoding kept its last tokens and lost its [CLS], which CLS pooling then missed."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:
        if (smollm2.hf_dir / name).is_file():
            shutil.copy(smollm2.hf_dir / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
            "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]},
        },
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = TextTokenizer.from_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path, truncation_side="left")
    text = "the quick brown fox jumps over the lazy dog"
    (ids,) = tokenizer.encode_batch([text])
    assert ids[0] == 1 and ids[-1] == 2
    for keep in (4, 6, len(ids), len(ids) + 3):
        want = reference(text, truncation=True, max_length=keep)["input_ids"]
        assert tokenizer.keep_last_tokens(ids, keep, from_text=True) == want, keep
    # NOTE: before, a cut to 1 or 2 kept [SEP] (or [CLS][SEP]) alone, silently.
    for keep in (1, 2):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens={keep} leaves no room"):
            tokenizer.keep_last_tokens(ids, keep, from_text=True)
    assert tokenizer.keep_last_tokens(ids, 2, from_text=False) == ids[-2:]
    plain = TextTokenizer.from_dir(smollm2.hf_dir)
    (plain_ids,) = plain.encode_batch([text])
    assert plain.keep_last_tokens(plain_ids, 4, from_text=True) == plain_ids[-4:]
    assert plain.keep_last_tokens(plain_ids, 1, from_text=True) == plain_ids[-1:]


def test_fewest_tokens_is_a_sure_lower_bound_or_nothing(tokenizer: TextTokenizer) -> None:
    texts = ["a", "hello world", "#" * 400, " " * 1000, "日本語 🤖 " * 50, "\n" * 300]
    for text in texts:
        (ids,) = tokenizer.encode_batch([text], add_special_tokens=False)
        assert 0 < tokenizer.fewest_tokens(text) <= len(ids), repr(text[:20])
    # NOTE: SmolLM2's vocabulary has no symbol for a few control bytes: they make no token.
    for text in ("", "\x04" * 5000, "\x04" * 5000 + "hi"):
        (ids,) = tokenizer.encode_batch([text], add_special_tokens=False)
        assert tokenizer.fewest_tokens(text) <= len(ids) <= 1, repr(text[-5:])
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    lowered = Tokenizer(models.BPE({"a": 0}, []))
    lowered.normalizer = normalizers.Lowercase()
    lowered.pre_tokenizer = pre_tokenizers.ByteLevel()
    dropping = Tokenizer(models.BPE({"a": 0}, []))
    dropping.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()]
    )
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    stripping = Tokenizer.from_str(tokenizer.backend.to_str())
    stripping.add_special_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    for backend in (wordpiece, lowered, dropping, word_level, stripping):
        assert TextTokenizer(backend, {}).fewest_tokens(" " * 10_000) == 0
    unknown = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=True))
    unknown.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert TextTokenizer(unknown, {}).fewest_tokens("x" * 10_000) <= 1


def test_openai_content_format_keeps_each_text_part(tokenizer: TextTokenizer) -> None:
    """As vLLM: the parts were joined into one, so a template looping over them rendered
    "Describe:\na cat" where vLLM renders "Describe:a cat"."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}|{% endfor %}"
        "{% endfor %}"
    )
    parts = [{"type": "text", "text": "Describe:"}, {"type": "text", "text": "a cat"}]
    conversation = [{"role": "user", "content": parts}, {"role": "assistant", "content": "It"}]
    rendered = tokenizer.apply_chat_template(
        conversation, False, chat_template=template, content_format="openai"
    )
    assert rendered == "<user>Describe:|a cat|<assistant>It|"
    continued = tokenizer.apply_chat_template(
        conversation[:1],
        False,
        chat_template=template,
        content_format="openai",
        continue_final_message=True,
    )
    assert continued == "<user>Describe:|a cat"
