"""Pooling end to end through LLM: embeddings against sentence-transformers, classifier logits and
prompt logprobs against transformers, on tiny random models, prompts of mixed lengths, under
chunked prefill and the prefix cache; the error rows."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.tiny_pooling import write_tiny_classifier, write_tiny_embedder
from vbatch import LLM
from vbatch.client.outputs import Request
from vbatch.client.pooling_outputs import perplexity_of
from vbatch.errors import ModelLoadError, PromptTypeError, PromptValueError
from vbatch.llm_pooling import CROSS_ENCODER
from vbatch.models.loader import ResolvedModel
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.sampling_params import SamplingParams

TEXTS = [
    "hello world",
    "x",
    "a much longer sentence about embeddings, pooling and batch jobs " * 6,
    "The quick brown fox jumps over the lazy dog.",
]
# NOTE: small steps, so generation prompts are chunked and pooling steps hold several prompts.
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, smollm2: ResolvedModel) -> Path:
    out = tmp_path_factory.mktemp("tiny-embedder")
    write_tiny_embedder(out, smollm2.hf_dir)
    return out


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def classifier(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    smollm2: ResolvedModel,
) -> tuple[Any, Path]:
    """A tiny LlamaForSequenceClassification, and Gemma3TextForSequenceClassification (a
    text-only class name that is not `<the causal LM's prefix>ForSequenceClassification`)."""
    out = tmp_path_factory.mktemp(f"tiny-classifier-{request.param}")
    return write_tiny_classifier(out, smollm2.hf_dir, family=request.param), out


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_match_sentence_transformers(embedder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedder), device="cpu").encode(TEXTS)
    with LLM(str(embedder), **ENGINE) as llm:
        outs = llm.embed(TEXTS)
        short = llm.embed(TEXTS, dimensions=16)
        (pair,) = llm.embed([Request(prompt=TEXTS[:2])])
        too_wide = llm.embed("x", dimensions=65)[0]
        classified = llm.classify("x")[0]
    for out, ref in zip(outs, reference, strict=True):
        got = np.array(out.outputs.embedding)
        assert out.error is None and got.shape == (64,)
        assert _cosine(got, ref) >= 0.99999
        assert np.abs(got - ref).max() <= 1e-4
    for out, ref in zip(short, reference, strict=True):
        want = ref[:16] / np.linalg.norm(ref[:16])
        assert np.abs(np.array(out.outputs.embedding) - want).max() <= 1e-4
    assert np.abs(np.array(pair.outputs.embedding) - reference[:2]).max() <= 1e-4
    assert too_wide.error is not None and "embedding size 64" in too_wide.error
    assert classified.error is not None and "ForSequenceClassification" in classified.error


def test_classifier_logits_match_transformers(classifier: tuple[Any, Path]) -> None:
    model, path = classifier
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.classify(TEXTS)
        # NOTE: transformers scores the last token that is not the pad token (0 here).
        padded = llm.classify([{"prompt_token_ids": [500, 600, 700, 0, 0]}], use_tqdm=False)
        rewards = llm.reward(TEXTS[:1])
        # NOTE: as vLLM's, encode's classify data are the probabilities, unless use_activation
        # is False (the logits, as LLM.classify's probs then are).
        encoded = llm.encode(TEXTS[:2], pooling_task="classify", use_tqdm=False)
        raw = PoolingParams(task="classify", use_activation=False)
        encoded_raw = llm.encode(TEXTS[:2], raw, use_tqdm=False)
        classified_raw = llm.classify(TEXTS[:2], pooling_params=[raw, PoolingParams()])
        # NOTE: its label was the argmax over both strings' probabilities, flattened.
        with pytest.raises(PromptTypeError, match="classify takes one text per prompt"):
            llm.classify([TEXTS[:2]])
        # NOTE: a cross-encoder scores a pair with its head; a cosine of embeddings would not.
        scored = llm.score("query", TEXTS[:2], use_tqdm=False)
    assert [s.error for s in scored] == [CROSS_ENCODER] * 2
    assert all(math.isnan(s.outputs.score) for s in scored)
    for out in [*outs, *padded]:
        with torch.no_grad():
            want = model(torch.tensor([out.prompt_token_ids])).logits[0].numpy()
        assert np.abs(np.array(out.outputs.logits) - want).max() <= 1e-4
        # NOTE: the probabilities are the softmax of vbatch's own logits, which may differ from
        # transformers' by the 1e-4 above (3.7e-6 in a probability on AVX2, where the GEMMs sum
        # in another order); against transformers' they are as close as the logits allow.
        probs = torch.softmax(torch.tensor(out.outputs.logits, dtype=torch.float64), -1).numpy()
        assert np.abs(np.array(out.outputs.probs) - probs).max() <= 1e-6
        want_probs = torch.softmax(torch.from_numpy(want).double(), -1).numpy()
        assert np.abs(np.array(out.outputs.probs) - want_probs).max() <= 1e-4
        assert out.outputs.label == f"label_{int(np.argmax(want))}"
    assert np.allclose(rewards[0].outputs.data, outs[0].outputs.logits)
    for i in range(2):
        assert np.allclose(encoded[i].outputs.data, outs[i].outputs.probs, atol=1e-6)
        assert np.allclose(encoded_raw[i].outputs.data, outs[i].outputs.logits)
    assert np.allclose(classified_raw[0].outputs.probs, outs[0].outputs.logits)
    assert np.allclose(classified_raw[1].outputs.probs, outs[1].outputs.probs)
    # NOTE: vLLM's tensor takes in-place operations; a view of the message's bytes did not.
    rewards[0].outputs.data /= 2


def test_classify_follows_the_config_s_problem_type(
    classifier: tuple[Any, Path], tmp_path: Path
) -> None:
    """As vLLM: sigmoid per label for multi-label classification, the logits themselves for a
    regression (a softmax over labels was given for both)."""
    _, path = classifier
    for problem_type in ("multi_label_classification", "regression"):
        copy = tmp_path / problem_type
        shutil.copytree(path, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "problem_type": problem_type}))
        with LLM(str(copy), **ENGINE) as llm:
            (out,) = llm.classify(TEXTS[:1], use_tqdm=False)
        logits = np.array(out.outputs.logits, dtype=np.float64)
        want = 1 / (1 + np.exp(-logits)) if problem_type != "regression" else logits
        assert np.abs(np.array(out.outputs.probs) - want).max() <= 1e-6, problem_type


def _reference_logprobs(model_dir: Path, prompt_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: log_softmax of transformers' logits at each prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def test_prompt_logprobs_match_transformers(tiny_model_dir: Path) -> None:
    # NOTE: the second prompt shares the first's 40-token prefix, which the prefix cache then
    # holds; prompt logprobs are computed by a pass that does not use it.
    prefix = TEXTS[2]
    prompts = [prefix, prefix + " and more", TEXTS[0]]
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    with LLM(str(tiny_model_dir), enable_prefix_caching=True, **ENGINE) as llm:
        plain = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
        outs = llm.generate(prompts, params)
        (scored,) = llm.encode(
            Request(prompt=prompts[1]), PoolingParams(PoolingTask.PROMPT_LOGPROBS)
        )
        tokenizer = llm.get_tokenizer()
    for out, base in zip(outs, plain, strict=True):
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
        ids = out.prompt_token_ids
        want = _reference_logprobs(tiny_model_dir, ids)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            assert entry is not None
            token = ids[pos + 1]
            assert abs(entry[token].logprob - want[pos, token].item()) <= 1e-4
            # NOTE: texts as the sampled tokens' logprobs give them, not BPE pieces ("Ġword").
            for alt, logprob in entry.items():
                assert logprob.decoded_token == tokenizer.decode([alt])
            # NOTE: a rank counts the tokens above this one, within the logprobs' tolerance.
            value = entry[token].logprob
            above = int((want[pos] > value + 1e-4).sum()) + 1
            assert above <= entry[token].rank <= int((want[pos] > value - 1e-4).sum()) + 1
            top = torch.topk(want[pos], 2)
            for rank, (value, alt) in enumerate(zip(top.values, top.indices), start=1):
                assert abs(entry[int(alt)].logprob - value.item()) <= 1e-4
                assert entry[int(alt)].rank == rank or int(alt) == token
    ids = scored.prompt_token_ids
    want = _reference_logprobs(tiny_model_dir, ids)
    targets = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    assert np.abs(scored.outputs.data - targets).max() <= 1e-4
    total, perplexity = perplexity_of(scored.outputs.data)
    assert abs(perplexity - np.exp(-targets.astype(np.float64).mean())) <= 1e-3 * perplexity
    assert abs(total - targets.sum()) <= 1e-3


def test_conversations_are_embedded_through_the_chat_template(embedder: Path) -> None:
    """A conversation, alone or in a list, is embedded as a Request with those messages (the
    form a job's `messages` rows take); a list of anything else is refused, not an error row."""
    first = [{"role": "user", "content": "hello world"}]
    second = [*first, {"role": "assistant", "content": "hi"}]
    with LLM(str(embedder), **ENGINE) as llm:
        (alone,) = llm.embed(first)
        listed = llm.embed([first, second, "hello world"])
        by_request = llm.embed([Request(messages=first), Request(messages=second)])
        with pytest.raises(PromptTypeError, match="conversation"):
            llm.embed([["hello", {"prompt": "world"}]])
        assert llm.embed("x")[0].error is None
    template = llm.get_tokenizer().apply_chat_template(first, add_generation_prompt=True)
    assert alone.prompt_token_ids == by_request[0].prompt_token_ids == template
    for out, ref in zip([alone, *listed[:2]], [by_request[0], *by_request], strict=True):
        assert out.error is None
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs.embedding == ref.outputs.embedding
    assert listed[2].prompt_token_ids == llm.get_tokenizer().encode("hello world")


def test_pooling_params_may_be_one_per_prompt(embedder: Path) -> None:
    """As vLLM's pooling calls: a list of PoolingParams, one per prompt; request ids are
    strings, as generation's."""
    per_prompt = [PoolingParams(dimensions=8), PoolingParams()]
    with LLM(str(embedder), **ENGINE) as llm:
        embedded = llm.embed(["hello world", "x"], pooling_params=per_prompt)
        encoded = llm.encode(["hello world", "x"], per_prompt)
        with pytest.raises(PromptValueError, match="one per prompt"):
            llm.embed(["hello world", "x"], pooling_params=per_prompt[:1])
        with pytest.raises(PromptTypeError, match="PoolingParams"):
            llm.embed(["x"], pooling_params=["dimensions=8"])
    assert [len(out.outputs.embedding) for out in embedded] == [8, 64]
    assert [out.outputs.data.shape for out in encoded] == [(8,), (64,)]
    assert [out.request_id for out in [*embedded, *encoded]] == ["0", "1", "0", "1"]


def test_long_prompts_are_errors_unless_truncated(embedder: Path) -> None:
    long_text = "word " * 600
    with LLM(str(embedder), **ENGINE) as llm:
        refused, kept = llm.embed([long_text, "short"])
        (truncated,) = llm.embed(long_text, truncate_prompt_tokens=100)
    assert refused.error is not None and "601 tokens" in refused.error
    assert "truncate_prompt_tokens" in refused.error
    assert kept.error is None
    assert truncated.error is None and len(truncated.prompt_token_ids) == 100


@pytest.mark.slow
def test_pooling_and_prompt_logprobs_under_data_parallel(
    embedder: Path, tiny_model_dir: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    texts = TEXTS * 4
    reference = SentenceTransformer(str(embedder), device="cpu").encode(texts)
    engine = {**ENGINE, "num_threads": 2}
    with LLM(str(embedder), data_parallel_size=2, **engine) as llm:
        outs = llm.embed(texts)
    for out, ref in zip(outs, reference, strict=True):
        assert np.abs(np.array(out.outputs.embedding) - ref).max() <= 1e-4
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    with LLM(str(tiny_model_dir), data_parallel_size=2, **engine) as llm:
        generated = llm.generate(texts, params)
    for out in generated:
        ids = out.prompt_token_ids
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        if len(ids) < 2:
            continue
        want = _reference_logprobs(tiny_model_dir, ids)
        targets = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        got = [entry[ids[pos + 1]].logprob for pos, entry in enumerate(out.prompt_logprobs[1:])]
        assert np.abs(np.array(got) - targets).max() <= 1e-4


@pytest.mark.gpu
def test_pooling_and_prompt_logprobs_on_cuda(embedder: Path, tiny_model_dir: Path) -> None:
    """The CUDA path (float32): embeddings against sentence-transformers, prompt logprobs and
    perplexity against transformers, with prompts chunked across steps."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedder), device="cpu").encode(TEXTS)
    engine = {**ENGINE, "device": "cuda", "dtype": "float32"}
    with LLM(str(embedder), **engine) as llm:
        outs = llm.embed(TEXTS)
    for out, ref in zip(outs, reference, strict=True):
        assert out.error is None
        assert np.abs(np.array(out.outputs.embedding) - ref).max() <= 1e-4
    with LLM(str(tiny_model_dir), **engine) as llm:
        scored = llm.encode(
            [Request(prompt=text) for text in TEXTS[2:]], PoolingParams(PoolingTask.PROMPT_LOGPROBS)
        )
    for out in scored:
        ids = out.prompt_token_ids
        want = _reference_logprobs(tiny_model_dir, ids)
        targets = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        assert out.error is None
        assert np.abs(out.outputs.data - targets).max() <= 5e-4
        _, perplexity = perplexity_of(out.outputs.data)
        assert abs(perplexity - np.exp(-targets.astype(np.float64).mean())) <= 1e-3 * perplexity


def test_a_bad_sentence_bert_config_fails_the_start(tmp_path: Path, embedder: Path) -> None:
    """It failed the first rows, after a job had been made that no resume could finish."""
    bad = tmp_path / "bad"
    shutil.copytree(embedder, bad)
    (bad / "sentence_bert_config.json").write_text('{"max_seq_length": -1}')
    with pytest.raises(ModelLoadError, match="max_seq_length must be a positive integer"):
        LLM(str(bad), **ENGINE)


def test_sentence_bert_config_caps_and_lowercases_as_sentence_transformers(
    tmp_path: Path, embedder: Path
) -> None:
    """A decoder embedder's `max_seq_length` below its positions was ignored (a longer prompt
    embedded whole, unlike sentence-transformers' and the BERT path), and `do_lower_case`
    nowhere: a text with capitals embedded differently from sentence-transformers."""
    import shutil

    from sentence_transformers import SentenceTransformer

    model = tmp_path / "lower"
    shutil.copytree(embedder, model)
    (model / "sentence_bert_config.json").write_text(
        '{"max_seq_length": 24, "do_lower_case": true}'
    )
    texts = ["Hello World", "THE Quick Brown Fox", "word " * 30]
    reference = SentenceTransformer(str(model), device="cpu").encode(texts[:2])
    chat = [{"role": "user", "content": "Hello World"}]
    with LLM(str(model), **ENGINE) as llm:
        outs = llm.embed(texts)
        (lowered,) = llm.embed(texts[0].lower())
        (message,) = llm.embed([Request(messages=chat)])
        (message_lowered,) = llm.embed([Request(messages=[{**chat[0], "content": "hello world"}])])
        # NOTE: -1 keeps max_seq_length tokens, as vLLM caps an embedder's length there.
        (kept,) = llm.embed(texts[2], truncate_prompt_tokens=-1)
        (last_24,) = llm.embed(texts[2], truncate_prompt_tokens=24)
        (encoded,) = llm.encode(texts[2], truncate_prompt_tokens=24)
    assert kept.error is None and kept.outputs.embedding == last_24.outputs.embedding
    assert encoded.error is None and encoded.outputs.data.tolist() == last_24.outputs.embedding
    assert len(kept.prompt_token_ids) == 24
    for out, ref in zip(outs[:2], reference, strict=True):
        assert out.error is None
        assert np.abs(np.array(out.outputs.embedding) - ref).max() <= 1e-4
    assert outs[0].prompt_token_ids == lowered.prompt_token_ids
    assert message.prompt_token_ids == message_lowered.prompt_token_ids
    assert outs[2].error is not None
    assert "more than sentence-transformers' max_seq_length of 24" in outs[2].error
