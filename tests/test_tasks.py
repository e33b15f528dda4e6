"""Jobs of every pooling task (job/tasks.py): embed to Parquet interrupted and resumed, sharded
and merged; classify and perplexity jobs; OpenAI /v1/embeddings lines."""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import torch
from helpers import SharedLLM, write_jsonl
from typer.testing import CliRunner

from benchmarks.tiny_pooling import write_tiny_classifier, write_tiny_embedder
from vbatch.cli import app
from vbatch.client.outputs import Request
from vbatch.errors import InputError
from vbatch.job.merge import merge_shards
from vbatch.job.rows import ColumnOptions
from vbatch.job.runner import JobSpec, RunOptions, resume_job, start_job
from vbatch.job.shard import Shard
from vbatch.lora.request import LoRARequest
from vbatch.models.loader import ResolvedModel

QUIET = RunOptions(display="quiet", commit_every_rows=4, max_in_flight=8)
RECORDS = [{"id": f"r{i}", "prompt": "some words " * (1 + i % 9) + str(i)} for i in range(24)]


def read_output(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2: ResolvedModel) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pooling-models")
    write_tiny_embedder(root / "embed", smollm2.hf_dir)
    classifier = write_tiny_classifier(root / "classify", smollm2.hf_dir)
    return {"embed": root / "embed", "classify": root / "classify", "classifier": classifier}


@pytest.fixture(scope="module")
def engines(models: dict[str, Any], tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    from vbatch.llm import LLM

    paths = {"embed": models["embed"], "classify": models["classify"], "lm": tiny_model_dir}
    started = {name: LLM(str(path), num_threads=1) for name, path in paths.items()}
    yield started
    for llm in started.values():
        llm.shutdown()


def _factory(llm: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: SharedLLM(llm)


class StoppingLLM(SharedLLM):
    """The shared engine, whose stream sends this process two SIGINTs after `after` results."""

    def __init__(self, llm: Any, after: int) -> None:
        super().__init__(llm)
        self.after = after

    def stream(self, inputs: Any, sampling_params: Any = None, **kwargs: Any) -> Iterator[Any]:
        results = (r for r in self.llm.stream(inputs, sampling_params, **kwargs) if r is not None)
        for n, result in enumerate(results, start=1):
            if n == self.after:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            yield result


def test_embed_job_resumes_and_shards_merge_to_the_same_rows(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any]
) -> None:
    llm = engines["embed"]
    input_path = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    job = JobSpec(input_path, tmp_path / "out.parquet", model=str(models["embed"]), task="embed")
    stopped = start_job(job, QUIET, llm_factory=lambda *a, **k: StoppingLLM(llm, 6))
    assert stopped.exit_code == 75 and 0 < stopped.status["done"] < len(RECORDS)
    assert (
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=_factory(llm)).exit_code == 0
    )
    table = pq.read_table(job.output_path)
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    rows = {r["id"]: r for r in table.to_pylist()}
    want = llm.embed([r["prompt"] for r in RECORDS])
    for record, out in zip(RECORDS, want, strict=True):
        row = rows[record["id"]]
        assert row["error"] is None and row["dimension"] == 64
        assert row["prompt_tokens"] == len(out.prompt_token_ids)
        assert np.abs(np.array(row["embedding"]) - out.outputs.embedding).max() <= 1e-6
    for index in range(2):
        shard_job = JobSpec(
            input_path,
            tmp_path / "merged.parquet",
            model=str(models["embed"]),
            task="embed",
            shard=Shard(index, 2),
        )
        assert start_job(shard_job, QUIET, llm_factory=_factory(llm)).exit_code == 0
    merge_shards(tmp_path / "merged.parquet", ordered=True)
    merged = {r["id"]: r["embedding"] for r in read_output(tmp_path / "merged.parquet")}
    assert merged.keys() == rows.keys()
    assert all(np.allclose(merged[k], rows[k]["embedding"], atol=1e-6) for k in rows)


def test_classify_and_perplexity_jobs(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], tiny_model_dir: Path
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", [*RECORDS[:6], {"id": "bad", "prompt": ""}])
    classify = JobSpec(
        input_path, tmp_path / "cls.jsonl", model=str(models["classify"]), task="classify"
    )
    assert start_job(classify, QUIET, llm_factory=_factory(engines["classify"])).exit_code == 0
    rows = {r["id"]: r for r in read_output(classify.output_path)}
    assert rows["bad"]["finish_reason"] == "error" and "label" in rows["bad"]
    tokenizer = engines["classify"].tokenizer
    for record in RECORDS[:6]:
        row = rows[record["id"]]
        ids = tokenizer.encode_batch([record["prompt"]], add_special_tokens=True)[0]
        with torch.no_grad():
            want = models["classifier"](torch.tensor([ids])).logits[0].numpy()
        assert np.abs(np.array(row["logits"]) - want).max() <= 1e-4
        assert row["label"] == f"label_{int(np.argmax(want))}" and abs(sum(row["probs"]) - 1) < 1e-5
    perplexity = JobSpec(
        input_path,
        tmp_path / "ppl.parquet",
        model=str(tiny_model_dir),
        task="perplexity",
        include_token_ids=True,
    )
    assert start_job(perplexity, QUIET, llm_factory=_factory(engines["lm"])).exit_code == 0
    for row in read_output(perplexity.output_path):
        if row["id"] == "bad":
            assert row["error"] is not None and row["perplexity"] is None
            continue
        assert row["scored_tokens"] == row["prompt_tokens"] - 1 == len(row["token_logprobs"])
        assert abs(row["logprob"] - sum(row["token_logprobs"])) <= 1e-3
        assert abs(np.log(row["perplexity"]) + row["logprob"] / row["scored_tokens"]) <= 1e-6


def test_openai_embeddings_lines(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any]
) -> None:
    def line(custom_id: str, body: dict[str, Any], url: str = "/v1/embeddings") -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    lines = [
        line("one", {"input": "hello world"}),
        line("two", {"input": ["hello world", "x y"], "encoding_format": "base64"}),
        line("short", {"input": "hello world", "dimensions": 8}),
        line("bad", {"input": 3}),
        line("unknown", {"input": "a", "user_field": 1}),
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", lines)
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(models["embed"]))
    assert start_job(job, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    out = {r["custom_id"]: r for r in read_output(job.output_path)}
    one = out["one"]["response"]["body"]
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0
    vector = np.array(one["data"][0]["embedding"], dtype=np.float32)
    two = out["two"]["response"]["body"]["data"]
    assert [d["index"] for d in two] == [0, 1]
    first = np.frombuffer(base64.b64decode(two[0]["embedding"]), dtype="<f4")
    assert np.abs(first - vector).max() <= 1e-6 and first.shape == (64,)
    short = np.array(out["short"]["response"]["body"]["data"][0]["embedding"])
    assert np.abs(short - vector[:8] / np.linalg.norm(vector[:8])).max() <= 1e-5
    assert "body.input" in out["bad"]["error"]["message"]
    assert "user_field" in out["unknown"]["error"]["message"]


def test_plain_rows_of_an_openai_file_and_row_settings_in_pooling_jobs(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], tiny_model_dir: Path
) -> None:
    """A plain row of an OpenAI Batch file gets the embeddings body in an embed job (it was
    computed, then written as a KeyError) and is an error row before it runs in a perplexity
    job; a plain row's own generation settings are an error row in any pooling job."""
    lines = [
        {"custom_id": "line", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}},
        {"custom_id": "plain", "prompt": "hi"},
        {"custom_id": "tokens", "prompt": "hi", "sampling_params": {"max_tokens": 5}},
        {"custom_id": "schema", "prompt": "hi", "response_format": {"type": "json_object"}},
        {"custom_id": "empty", "prompt": "hi", "sampling_params": {}},
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", lines)
    embed = JobSpec(
        input_path, tmp_path / "embed.jsonl", model=str(models["embed"]), task="embed", dimensions=8
    )
    assert start_job(embed, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    out = {r["custom_id"]: r for r in read_output(embed.output_path)}
    vector = out["line"]["response"]["body"]["data"][0]["embedding"]
    for custom_id in ("plain", "empty"):
        assert out[custom_id]["error"] is None
        body = out[custom_id]["response"]["body"]
        assert body["object"] == "list" and body["data"][0]["embedding"] == vector
    for custom_id in ("tokens", "schema"):
        message = out[custom_id]["error"]["message"]
        assert "generation settings, not read by a --task embed job" in message
    perplexity = JobSpec(
        input_path, tmp_path / "ppl.jsonl", model=str(tiny_model_dir), task="perplexity"
    )
    assert start_job(perplexity, QUIET, llm_factory=_factory(engines["lm"])).exit_code == 0
    out = {r["custom_id"]: r for r in read_output(perplexity.output_path)}
    assert "an embeddings line in a --task perplexity job" in out["line"]["error"]["message"]
    for custom_id in ("plain", "empty"):
        message = out[custom_id]["error"]["message"]
        assert "no OpenAI response shape in a --task perplexity job" in message
    # NOTE: `status` names a pooling job's task, not the sampling settings it does not read.
    statuses = [
        CliRunner().invoke(app, ["status", str(job.output_path)]).output
        for job in (embed, perplexity)
    ]
    assert "task:        embed, dimensions=8\n" in statuses[0]
    assert "task:        perplexity\n" in statuses[1]
    assert not any("sampling:" in status for status in statuses)


def test_a_list_input_embeddings_line_writes_its_vectors_to_parquet(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any]
) -> None:
    lines = [
        {"custom_id": "two", "url": "/v1/embeddings", "body": {"input": ["hello world", "x"]}},
        {"custom_id": "one", "url": "/v1/embeddings", "body": {"input": "hello world"}},
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", lines)
    job = JobSpec(input_path, tmp_path / "out.parquet", model=str(models["embed"]), task="embed")
    assert start_job(job, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    rows = {r["id"]: r for r in read_output(job.output_path)}
    first, second = rows["two"]["embeddings"]
    assert rows["two"]["embedding"] is None and len(first) == len(second) == 64
    assert np.abs(np.array(first) - np.array(rows["one"]["embedding"])).max() <= 1e-6


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_kept_input_columns_never_shadow_a_pooling_task_field(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], suffix: str
) -> None:
    """A classification dataset's own `label` column stays out of --keep-all-columns (the
    model's label is written), and --keep-columns label is refused."""
    records = [{"id": "a", "prompt": "hello", "label": "gold", "note": "kept"}]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = JobSpec(
        input_path,
        tmp_path / f"out{suffix}",
        model=str(models["classify"]),
        task="classify",
        columns=ColumnOptions(keep_all_columns=True),
    )
    assert start_job(job, QUIET, llm_factory=_factory(engines["classify"])).exit_code == 0
    (row,) = read_output(job.output_path)
    # NOTE: Parquet keeps a JSONL input's column as its JSON text.
    assert row["label"].startswith("label_") and row["note"] in ("kept", '"kept"')
    refused = dataclasses.replace(
        job,
        output_path=tmp_path / f"refused{suffix}",
        columns=ColumnOptions(keep_columns=("label",)),
    )
    with pytest.raises(InputError, match="--keep-columns label would overwrite output fields"):
        start_job(refused, QUIET, llm_factory=_factory(engines["classify"]))


def test_a_pooling_job_refuses_generation_options_and_a_model_without_the_tasks_head(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], tiny_model_dir: Path
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    lora = JobSpec(
        input_path,
        tmp_path / "lora.jsonl",
        model=str(tiny_model_dir),
        task="perplexity",
        engine_args={"enable_lora": True, "loras": [["a", str(tmp_path)]]},
    )
    with pytest.raises(InputError, match="--lora: generation only, not for a --task perplexity"):
        start_job(lora, QUIET, llm_factory=_factory(engines["lm"]))
    sampled = dataclasses.replace(
        lora, engine_args={}, sampling={"n": 2, "logprobs": 1}, reasoning_parser="qwen3"
    )
    with pytest.raises(InputError, match="--n, --logprobs, --reasoning-parser: generation only"):
        start_job(sampled, QUIET, llm_factory=_factory(engines["lm"]))
    # NOTE: sampling settings away from the job's defaults were accepted and had no effect.
    tuned = dataclasses.replace(
        lora,
        engine_args={},
        sampling={"max_tokens": 1, "temperature": 0.9, "stop": ["x"], "seed": 5, "top_p": 1.0},
    )
    with pytest.raises(
        InputError, match="--max-tokens, --temperature, --stop, --seed: generation only"
    ):
        start_job(tuned, QUIET, llm_factory=_factory(engines["lm"]))
    embed_ids = dataclasses.replace(
        lora, engine_args={}, task="embed", model=str(models["embed"]), include_token_ids=True
    )
    with pytest.raises(
        InputError, match="--include-token-ids: generation and --task perplexity only, not for a"
    ):
        start_job(embed_ids, QUIET, llm_factory=_factory(engines["embed"]))
    wrong_head = JobSpec(
        input_path, tmp_path / "cls.jsonl", model=str(models["embed"]), task="classify"
    )
    with pytest.raises(InputError, match=r"classify needs a \*ForSequenceClassification model"):
        start_job(wrong_head, QUIET, llm_factory=_factory(engines["embed"]))
    assert not (tmp_path / "cls.jsonl").exists()
    adapter = LoRARequest("a", 1, str(tmp_path))
    (pooled,) = engines["embed"].embed([Request(prompt="hello", lora_request=adapter)])
    assert "LoRA adapters run with generation only" in (pooled.error or "")
    (out,) = engines["classify"].generate(["hello"])
    assert out.outputs[0].finish_reason == "error"
    assert "generation needs a model with an LM head; this one has a classifier head" in (
        out.error or ""
    )


def test_embeddings_line_widths_against_the_jobs_dimensions(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any]
) -> None:
    """A line without dimensions takes the job's --dimensions; in Parquet, whose vector column
    has one width, a line asking for another is an error row, and the others commit."""
    lines = [
        {"custom_id": "eight", "url": "/v1/embeddings", "body": {"input": "a b", "dimensions": 8}},
        {"custom_id": "plain", "url": "/v1/embeddings", "body": {"input": "a b"}},
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", lines)
    full = JobSpec(input_path, tmp_path / "full.parquet", model=str(models["embed"]), task="embed")
    assert start_job(full, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    rows = {r["id"]: r for r in read_output(full.output_path)}
    assert len(rows["plain"]["embedding"]) == 64 and rows["plain"]["error"] is None
    assert "body.dimensions 8 is not this job's embedding width 64" in rows["eight"]["error"]
    wide_line = {"custom_id": "w", "url": "/v1/embeddings", "body": {"input": "a"}}
    wide_line["body"]["dimensions"] = 99
    wide = dataclasses.replace(
        full, input_path=write_jsonl(tmp_path / "wide.jsonl", [wide_line]),
        output_path=tmp_path / "wide.parquet",
    )  # fmt: skip
    assert start_job(wide, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    # NOTE: it said to give --dimensions 99, which the job refuses for this model.
    (row,) = read_output(wide.output_path)
    assert "body.dimensions 99 exceeds the model's embedding size 64" in row["error"]
    cut = dataclasses.replace(full, output_path=tmp_path / "cut.parquet", dimensions=8)
    assert start_job(cut, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    rows = {r["id"]: r for r in read_output(cut.output_path)}
    assert len(rows["plain"]["embedding"]) == len(rows["eight"]["embedding"]) == 8
    as_jsonl = dataclasses.replace(cut, output_path=tmp_path / "cut.jsonl")
    assert start_job(as_jsonl, QUIET, llm_factory=_factory(engines["embed"])).exit_code == 0
    for row in read_output(as_jsonl.output_path):
        assert len(row["response"]["body"]["data"][0]["embedding"]) == 8


def test_dimensions_are_refused_for_other_tasks_and_past_the_models_width(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], tiny_model_dir: Path
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    wide = JobSpec(
        input_path, tmp_path / "e.jsonl", model=str(models["embed"]), task="embed", dimensions=65
    )
    with pytest.raises(InputError, match="--dimensions 65 exceeds the model's embedding size 64"):
        start_job(wide, QUIET, llm_factory=_factory(engines["embed"]))
    ppl = JobSpec(
        input_path, tmp_path / "p.jsonl", model=str(tiny_model_dir), task="perplexity", dimensions=8
    )
    with pytest.raises(InputError, match="--dimensions: --task embed only"):
        start_job(ppl, QUIET, llm_factory=_factory(engines["lm"]))
    assert not (tmp_path / "e.jsonl").exists() and not (tmp_path / "p.jsonl").exists()


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_a_row_naming_an_adapter_in_a_job_without_adapters_is_an_error_row(
    tmp_path: Path, models: dict[str, Any], engines: dict[str, Any], task: str
) -> None:
    records = [{"id": "a", "prompt": "hi", "lora": "sql"}, {"id": "b", "prompt": "hi"}]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    llm = engines["embed" if task == "embed" else "lm"]
    model = models["embed"] if task == "embed" else llm.model.local_path
    sampling = {"max_tokens": 2} if task == "generate" else {}
    job = JobSpec(
        input_path, tmp_path / "out.jsonl", model=str(model), task=task, sampling=sampling
    )
    assert start_job(job, QUIET, llm_factory=_factory(llm)).exit_code == 0
    rows = {r["id"]: r for r in read_output(job.output_path)}
    assert "this job has no LoRA adapters" in rows["a"]["error"]
    assert rows["b"]["error"] is None


def test_score_takes_prompt_dicts_and_pooling_calls_name_what_they_refuse(
    engines: dict[str, Any],
) -> None:
    llm = engines["embed"]
    ids = llm.get_tokenizer().encode("a b", add_special_tokens=False)
    (plain,) = llm.score("a b", "c", use_tqdm=False)
    (as_dict,) = llm.score({"prompt": "a b"}, "c", use_tqdm=False)
    (as_ids,) = llm.score([{"prompt_token_ids": ids}], [{"prompt": "c"}], use_tqdm=False)
    assert as_dict.outputs.score == pytest.approx(plain.outputs.score, abs=1e-6)
    assert as_ids.outputs.score == pytest.approx(plain.outputs.score, abs=1e-5)
    assert as_dict.prompt_token_ids == plain.prompt_token_ids
    with pytest.raises(ValueError, match="2 text_1 against 3 text_2"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    adapter = LoRARequest("a", 1, "/nonexistent")
    with pytest.raises(Exception, match="LoRA adapters run with generation only"):
        llm.embed(["hi"], lora_request=adapter, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a prompt string"):
        llm.embed(None, use_tqdm=False)
