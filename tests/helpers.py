"""Helpers shared by several test modules: a shared real engine for jobs, a Qwen3-style chat
template, a SentencePiece-style tokenizer, JSONL files, process exits, a Hugging Face hub cache
laid out as `hf download` leaves it, a tiny core on the native linears and a greedy run on it."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

# NOTE: Qwen3's chat template, cut to what it does with plain messages: the history drops
# earlier answers' thinking, and the generation prompt opens an empty think block when
# `enable_thinking` is false.
QWEN3_STYLE_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def sentencepiece_backend() -> Tokenizer:
    """A Llama 2 style tokenizer of a few words: "▁" for spaces, byte fallback, a decoder that
    strips the text's first space; <s> and </s> special."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ("▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return backend


def with_chat_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A copy of `model_dir` whose chat_template.jinja is `template`."""
    shutil.copytree(model_dir, out_dir)
    (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


class SharedLLM:
    """The real engine, started once for the session or a module; a job's shutdown() leaves it
    running."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def shutdown(self) -> None:
        pass


# NOTE: a model file for jobs whose engine is a stand-in: a GGUF version 3 header (what a job
# checks before it exists), then no real content.
STANDIN_GGUF = b"GGUF\x03\x00\x00\x00stand-in weights"


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (a zombie awaiting a reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def add_to_hub_cache(
    cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str | None = "main"
) -> Path:
    """Put `model_dir`'s files in the hub cache `cache` as snapshot `commit` of `repo_id`: each
    file a blob named by its sha256, linked from snapshots/<commit>/ by a relative symlink, and
    refs/<ref> naming the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def native_core(model_dir: Path, greedy_screen: bool) -> EngineCore:
    """A one-thread core over `model_dir` whose linears all run the native packed kernel, with
    the int8 greedy screen on or off."""
    config = EngineConfig(
        model=str(model_dir),
        num_threads=1,
        num_kv_blocks=16,
        linear_backend="native",
        greedy_screen=greedy_screen,
    )
    return EngineCore(config)


def greedy_run(core: EngineCore, prompt: list[int]) -> tuple[list[int], list[float]]:
    """12 greedy tokens of `prompt` on `core`, and their logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    assert core.add_request(AddRequest("r", pack_token_ids(prompt), params)) == []
    tokens: list[int] = []
    logprobs: list[float] = []
    while core.has_unfinished():
        out = core.step()
        tokens += out.token_ids
        assert out.logprobs is not None
        logprobs += [lp.logprob for lp in out.logprobs if lp is not None]
    return tokens, logprobs
