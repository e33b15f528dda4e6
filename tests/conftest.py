"""Shared fixtures: the default SmolLM2 model, tiny random models (a Llama directory, one model
per supported family), the greedy check against transformers, the gpu marker."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers import SharedLLM

from benchmarks.tiny_model import tiny_family_configs, write_tiny_family, write_tiny_llama
from vbatch.models.loader import ResolvedModel, resolve_model

if TYPE_CHECKING:
    import torch

    from vbatch.client.tokenizer import TextTokenizer
    from vbatch.layers.attention import AttentionMetadata

# NOTE: set at import so engine subprocesses spawned by tests inherit the same cache.
os.environ.setdefault("VBATCH_CACHE_DIR", str(Path.home() / ".cache" / "vbatch-test"))
# NOTE: also before anything imports torch, so that the tests and the engine processes they
# spawn default to one intra-op thread: on a busy 2-core host a second OpenMP thread spins,
# waiting for a core another process holds (a tiny model's engine run took 24x the CPU time with
# two threads). Set OMP_NUM_THREADS to run with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# NOTE: `python -m vbatch.cli` subprocesses started from a temporary directory must import the
# vbatch under test, not whichever one the interpreter would find from there.
_VBATCH_ROOT = str(Path(__import__("vbatch").__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_VBATCH_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    # NOTE: torch is imported only when needed so torch-free modules can be tested as such.
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2() -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2: ResolvedModel) -> Path:
    """A random-weight 2-layer Llama sharing SmolLM2's tokenizer (vocab 49152, tied)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2.hf_dir)


@pytest.fixture(scope="session")
def tiny_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Every family's tiny random model (benchmarks/tiny_model.py): name → (the transformers
    model, float32 with eager attention, and the directory it was saved to)."""
    root = tmp_path_factory.mktemp("tiny-families")
    return {
        name: (write_tiny_family(name, root / name), root / name) for name in tiny_family_configs()
    }


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a flat batch: seq i writes its last query_lens[i] of seq_lens[i] positions."""
    import numpy as np
    import torch

    from vbatch.layers.attention import AttentionMetadata

    slots: list[int] = []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        assert len(table) * block_size >= seq_len
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


@pytest.fixture
def make_attention_metadata() -> Callable[..., AttentionMetadata]:
    """build_attention_metadata(query_lens, seq_lens, block_tables, block_size, device)."""
    return build_attention_metadata


EXAMPLE_PROMPTS = Path(__file__).parents[1] / "examples" / "prompts.jsonl"
TIE_TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def chat_messages() -> list[list[dict[str, str]]]:
    """The 16 first chat conversations of the bundled example."""
    rows = [json.loads(line) for line in EXAMPLE_PROMPTS.read_text().splitlines()]
    return [row["messages"] for row in rows[:16]]


@pytest.fixture(scope="session")
def tokenizer(smollm2: ResolvedModel) -> TextTokenizer:
    """The client-side tokenizer of the default model."""
    from vbatch.client.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(smollm2.hf_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer: TextTokenizer, chat_messages: list[list[dict[str, str]]]) -> list[list[int]]:
    """The example conversations rendered with SmolLM2's chat template, as token ids."""
    return tokenizer.encode_chats(chat_messages)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2: ResolvedModel) -> Any:
    """transformers' SmolLM2 (float32, eval mode), loaded once for every test that reads it."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def assert_greedy_matches_hf(smollm2_hf: Any) -> Callable[..., None]:
    """A check that every generated token is transformers' greedy choice given the same prefix.

    NOTE: the reference logits come from one full forward pass over prompt + generated tokens
    (teacher forcing). transformers 5's own cached `generate` drifts by up to ~0.1 in the logits
    from its full forward pass on this model, too coarse for the 1e-4 tie check.
    """

    def check(prompts: list[list[int]], got: list[list[int]]) -> None:
        check_greedy_against(smollm2_hf, prompts, got)

    return check


@pytest.fixture(scope="session")
def greedy_check() -> Callable[[Any, list[list[int]], list[list[int]]], None]:
    """check_greedy_against(hf_model, prompts, got), for any transformers model."""
    return check_greedy_against


def check_greedy_against(hf_model: Any, prompts: list[list[int]], got: list[list[int]]) -> None:
    """Every token of got[i] is transformers' greedy choice after prompts[i] and the tokens
    before it, or within TIE_TOLERANCE of it (one teacher-forced full forward per prompt)."""
    import torch

    for i, (ids, tokens) in enumerate(zip(prompts, got, strict=True)):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        best = logits.argmax(-1).tolist()
        for pos, (ours, ref) in enumerate(zip(tokens, best, strict=True)):
            if ours != ref:
                gap = float(logits[pos, ref] - logits[pos, ours])
                assert gap <= TIE_TOLERANCE, (
                    f"prompt {i} token {pos}: vbatch chose {ours}, transformers {ref}, "
                    f"whose logit is higher by {gap}"
                )


@pytest.fixture(scope="session")
def shared_llm(tiny_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """A factory for jobs (`llm_factory`) lending them one tiny-model engine, started once for
    the session; a job's shutdown() leaves it running."""
    from vbatch.llm import LLM

    llm = LLM(str(tiny_model_dir), num_threads=1, max_num_seqs=16)
    yield lambda *args, **kwargs: SharedLLM(llm)
    llm.shutdown()
