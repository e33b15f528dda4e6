"""TextTokenizer: the client's fast tokenizer and chat-template renderer, free of torch."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models

from vbatch.errors import InputError, ModelLoadError
from vbatch.models.config import json_object

# NOTE: the names the renderer itself passes; a template kwarg may not replace them.
RENDER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# NOTE: what transformers' apply_chat_template takes as settings, not template variables.
SETTING_NAMES = frozenset({"chat_template", "continue_final_message"})
# NOTE: appended to the message continue_final_message continues, to find where its content ends
# in the rendered text; its trailing space tells whether the template kept the content's own
# trailing whitespace (then it stays, as in transformers).
# NOTE: transformers' own tag: plain ASCII, so a template's `tojson` keeps it as it is.
CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "
# NOTE: a message's reasoning under any of these names reaches a template under the first two,
# as transformers aliases them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# NOTE: the pre-tokenizers that leave every byte of a text in some piece (a "Removed" split
# drops its matches); with ByteLevel among them every byte has a symbol, so no text is lost.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})
CONTENT_FORMATS = ("auto", "string", "openai")
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (it only marks spans)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja2's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers renders with."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def validate_messages(messages: Any, what: str = "messages") -> list[dict[str, Any]]:
    """The one rule set for a conversation, for the job's rows and for rendering: a non-empty
    list of objects with a string `role` and a `content` that is a string or a list of text
    parts (joined with newlines, as vLLM does); an assistant's content may be null or absent
    (a message with only tool calls), and is then "". Returns shallow copies without
    None-valued keys; raises InputError naming the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InputError(
            f"{what} must be a non-empty list of {{'role', 'content'}} objects, "
            f"got {messages!r:.80}"
        )
    checked = []
    for i, message in enumerate(messages):
        where = f"{what}[{i}]"
        if not isinstance(message, Mapping):
            raise InputError(
                f"{where} must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise InputError(f"{where} must have a string 'role', got {role!r:.80}")
        copy = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if content is None and role != "assistant":
            raise InputError(f"{where} has no 'content' (only an assistant's may be null)")
        if content is None:
            # NOTE: templates concatenate content; "" is as falsy as null where they test it.
            copy["content"] = ""
        elif isinstance(content, list):
            copy["content"] = _join_text_parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise InputError(
                f"{where}.content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        checked.append(copy)
    return checked


def _join_text_parts(parts: list[Any], what: str) -> str:
    """OpenAI content parts as one text: text parts joined; any other part refused."""
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(kind, str) and kind != "text":
            raise InputError(
                f"{what}[{k}] is a {kind!r} part; the model is text-only, so content parts must "
                "be text parts"
            )
        else:
            raise InputError(f"{what}[{k}] must be {{'type': 'text', 'text': string}}")
    return "\n".join(texts)


def _text_parts(original: Any, joined: str) -> list[dict[str, str]]:
    """A checked message's content as OpenAI text parts: the original's own parts (never
    empty: one empty part stands for none), else one part of its text."""
    if isinstance(original, list):
        parts = [{"type": "text", "text": part["text"]} for part in original]
        return parts or [{"type": "text", "text": ""}]
    return [{"type": "text", "text": joined}]


def check_template_kwargs(value: Any, what: str = "chat_template_kwargs") -> dict[str, Any]:
    """Check extra chat-template variables (e.g. {"enable_thinking": false}); a copy."""
    if not isinstance(value, Mapping):
        raise InputError(f"{what} must be an object of template variables, got {value!r:.80}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise InputError(f"{what} has the key {key!r}, which is not a template variable name")
        if key in RENDER_NAMES:
            raise InputError(f"{what} may not set {key!r}: vbatch sets it when rendering")
        if key in SETTING_NAMES:
            raise InputError(
                f"{what} may not set {key!r}: it says how the template is applied, not what "
                "it renders (LLM.chat takes it as an argument)"
            )
    return dict(value)


def _json_file(path: Path) -> dict[str, Any]:
    """A tokenizer directory's JSON object file; empty where there is none."""
    if not path.is_file():
        return {}
    try:
        return json_object(path.read_text(encoding="utf-8"), path)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None


def _token_content(value: Any) -> str | None:
    # NOTE: tokenizer_config stores special tokens as a string or as a serialized AddedToken.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The model's chat templates by name, as transformers reads them: chat_template.jinja
    ("default") with additional_chat_templates/*.jinja, else tokenizer_config.json's
    `chat_template` (one string, or a list of {"name", "template"})."""
    templates: dict[str, str] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
        for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
            templates[extra.stem] = extra.read_text(encoding="utf-8")
        return templates
    template = config.get("chat_template")
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name"))] = entry["template"]
    elif isinstance(template, str):
        templates["default"] = template
    return templates


@functools.cache
def _byte_symbols() -> tuple[str, ...]:
    """The byte-level pre-tokenizer's symbol for each byte value (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the others for the code points from U+0100 on)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = (b for b in range(256) if b not in printable)
    symbols = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return tuple(symbols[b] for b in range(256))


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class TextTokenizer:
    """Encodes prompts, renders chat templates and decodes ids for one model.

    Invariants: `special_token_ids` are the ids `decode(..., skip_special_tokens=True)` drops;
    `special_tokens` maps names like "eos_token" to their text and is what templates see;
    encoding follows the tokenizer.json post-processor (it adds BOS only where the model does).
    """

    def __init__(
        self,
        backend: Tokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        named_templates: Mapping[str, str] | None = None,
    ) -> None:
        # NOTE: a tokenizer.json may pad or truncate (sentence-transformers checkpoints do): a
        # prompt's ids are its own, whole; a too long one is refused, or truncated when asked.
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        # NOTE: the model's other named templates ("tool_use", "rag"), chosen as transformers
        # chooses: by name, or "tool_use" when tools are given.
        self._named = {
            name: compile_chat_template(text) for name, text in (named_templates or {}).items()
        }
        self._other_templates: dict[str, jinja2.Template] = {}
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in added.items() if tok.special)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos is not None else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load tokenizer.json, tokenizer_config.json (with special_tokens_map.json) and the chat
        template from a directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {path}; vbatch needs a fast tokenizer")
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from None
        config = _json_file(path / "tokenizer_config.json")
        # NOTE: as transformers: special_tokens_map.json (older repos) wins over the config.
        named = {**config, **_json_file(path / "special_tokens_map.json")}
        special_tokens = {
            name: content
            for name in SPECIAL_TOKEN_NAMES
            if (content := _token_content(named.get(name))) is not None
        }
        templates = _read_chat_templates(path, config)
        default = templates.pop("default", None)
        try:
            return cls(backend, special_tokens, default, templates)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"the chat template in {path} does not compile: {exc}") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None or bool(self._named)

    @functools.cached_property
    def _added_around(self) -> tuple[int, int]:
        """How many special tokens encoding with add_special_tokens puts before and after a
        text (BOS; BERT's [CLS] and [SEP]), found on a probe text."""
        (full,) = self.encode_batch(["a"])
        (plain,) = self.encode_batch(["a"], add_special_tokens=False)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return start, len(full) - start - len(plain)
        return 0, 0

    @functools.cached_property
    def _byte_bound(self) -> tuple[int, bytes] | None:
        """(the most UTF-8 bytes of text one token stands for, the bytes no token holds), where
        a bound is sure: a byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) with no normalizer,
        pre-tokenizers that keep every byte, and no added token that strips the whitespace
        beside it; else None. A byte-level token's string has a symbol per byte of its text, so
        its UTF-8 length is never below that text's, nor an added token's below its own text;
        a byte whose symbol is not in the vocabulary (a few control characters) is dropped or
        becomes an unknown token that may stand for a run of them, so it counts for nothing."""
        backend = self.backend
        if not isinstance(backend.model, models.BPE) or backend.normalizer is not None:
            return None
        if backend.pre_tokenizer is None:
            return None
        state = json.loads(backend.pre_tokenizer.__getstate__())
        pieces = state.get("pretokenizers", []) if state.get("type") == "Sequence" else [state]
        keeps_every_byte = any(p.get("type") == "ByteLevel" for p in pieces) and all(
            p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
            for p in pieces
        )
        added = backend.get_added_tokens_decoder().values()
        if not keeps_every_byte or any(token.lstrip or token.rstrip for token in added):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        symbols = _byte_symbols()
        unknown = bytes(b for b, symbol in enumerate(symbols) if symbol not in vocab)
        return max((len(token.encode()) for token in vocab), default=1), unknown

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, found without encoding it: its UTF-8
        bytes that some token holds, over the most one token holds, where _byte_bound is sure;
        else 0. A prompt far past the model's length is refused by it before its encoding takes
        memory by the gigabyte."""
        bound = self._byte_bound
        if bound is None:
            return 0
        longest, unknown = bound
        known = len(text.encode("utf-8", "surrogatepass").translate(None, unknown))
        return -(-known // longest)

    def keep_last_tokens(self, token_ids: list[int], keep: int, from_text: bool) -> list[int]:
        """Token ids cut to their last `keep`; those of a text (`from_text`: encoded with
        add_special_tokens) keep the special tokens the encoding added, as transformers
        truncates on the left (and vLLM a text prompt): a CLS-pooled embedding still pools
        [CLS]. A ValueError says when `keep` leaves the text no room beside those."""
        before, after = self._added_around if from_text else (0, 0)
        if len(token_ids) <= keep:
            return token_ids
        if keep <= before + after:
            raise ValueError(
                f"truncate_prompt_tokens={keep} leaves no room for the text beside the "
                f"{before + after} special tokens the tokenizer adds to it"
            )
        end = len(token_ids) - after
        return (
            token_ids[:before] + token_ids[before:end][-(keep - before - after) :] + token_ids[end:]
        )

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids for each text; pass add_special_tokens=False for chat-rendered text."""
        encodings = self.backend.encode_batch_fast(
            list(texts), add_special_tokens=add_special_tokens
        )
        return [enc.ids for enc in encodings]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        content_format: str = "auto",
    ) -> str:
        """Render one conversation to prompt text, exactly as transformers does; `template_kwargs`
        are extra template variables, as transformers' `apply_chat_template(**kwargs)` takes.
        `chat_template` replaces the model's, or names one of its named templates (tools given
        without one pick "tool_use" where the model has it, as transformers does);
        `continue_final_message` ends the text right
        after the last message's content, so generation continues it. `content_format` is
        vLLM's chat_template_content_format: "auto" and "string" give the template each
        message's content as text, "openai" as a list of {"type": "text", "text": ...} parts."""
        if content_format not in CONTENT_FORMATS:
            raise InputError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {content_format!r:.40}"
            )
        template = self._template
        tools = (template_kwargs or {}).get("tools")
        if chat_template is None and tools is not None and "tool_use" in self._named:
            template = self._named["tool_use"]
        elif chat_template == "default" and self._named and self._template is not None:
            # NOTE: as transformers: beside named ones, the model's own template is "default".
            template = self._template
        elif chat_template in self._named:
            template = self._named[chat_template]
        elif chat_template is not None:
            template = self._other_templates.get(chat_template)
            if template is None:
                try:
                    template = compile_chat_template(chat_template)
                except jinja2.TemplateSyntaxError as exc:
                    raise InputError(f"chat_template does not compile: {exc}") from None
                self._other_templates[chat_template] = template
        if template is None and self._named:
            raise InputError(
                f"this model's chat templates are named ({', '.join(sorted(self._named))}) with "
                "no default: name one with chat_template"
            )
        if template is None:
            raise InputError(
                "this model has no chat template, so 'messages' rows cannot be used; "
                "pass a 'prompt' string instead"
            )
        checked = [_with_reasoning_aliases(m) for m in validate_messages(messages)]
        if content_format == "openai":
            # NOTE: as vLLM, each text part stays a part (templates loop over them).
            checked = [
                {**m, "content": _text_parts(original.get("content"), m["content"])}
                for original, m in zip(messages, checked, strict=True)
            ]
        last = checked[-1]["content"]
        final = last[-1]["text"] if isinstance(last, list) else last
        if continue_final_message:
            if isinstance(last, list):
                marked = [*last[:-1], {"type": "text", "text": final + CONTINUE_MARK}]
                checked[-1] = {**checked[-1], "content": marked}
            else:
                checked[-1] = {**checked[-1], "content": final + CONTINUE_MARK}
        text = self._render(template, checked, add_generation_prompt, template_kwargs)
        if not continue_final_message:
            return text
        end = text.rfind(CONTINUE_MARK.strip())
        if end < 0 or final.strip() not in text:
            raise InputError(
                "continue_final_message: the last message's content is not in the rendered text"
            )
        if text.startswith(CONTINUE_MARK, end):
            return text[:end]
        # NOTE: the template strips the content, so its trailing whitespace is gone as well.
        return text[:end].rstrip()

    def _render(
        self,
        template: jinja2.Template,
        checked: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        try:
            # NOTE: template_kwargs may give `tools` (LLM.chat's); check_template_kwargs keeps
            # rows' and users' kwargs from setting it or the other render names.
            return template.render(
                {
                    "tools": None,
                    "documents": None,
                    **self.special_tokens,
                    **(template_kwargs or {}),
                    "messages": checked,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except jinja2.TemplateError as exc:
            raise InputError(f"the chat template rejected the messages: {exc}") from None
        except Exception as exc:
            # NOTE: templates assume types (a string to concatenate, a list to loop over) that a
            # row may break, e.g. numbers in tool_calls or chat_template_kwargs: the row's fault.
            raise InputError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None

    def encode_chats(
        self,
        conversations: Sequence[list[dict[str, Any]]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[list[int]]:
        """Render and encode conversations; templates carry their own BOS, so none is added."""
        texts = [
            self.apply_chat_template(m, add_generation_prompt, template_kwargs)
            for m in conversations
        ]
        return self.encode_batch(texts, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in token_ids]
