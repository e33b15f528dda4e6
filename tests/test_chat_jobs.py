"""Chat-template variables and reasoning output end to end, on the tiny model with a Qwen3-style
template: the Python API (LLM default, per Request) and jobs (per run, per row, after a resume;
JSONL, Parquet)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers import QWEN3_STYLE_TEMPLATE, SharedLLM, read_jsonl, with_chat_template, write_jsonl

from vbatch.errors import EngineStartupError
from vbatch.job.runner import JobSpec, RunOptions, job_dir_for, resume_job, start_job
from vbatch.llm import LLM, Request
from vbatch.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
THINKING = {"regex": "<think>[a-z]{1,4}</think> [a-z]{1,4}"}
# NOTE: 9 tokens hold `<think>` (7 characters) but never 30 letters and `</think>` too.
LONG_THINKING = {"regex": "<think>[a-z]{30,40}</think> [a-z]{1,4}"}


@pytest.fixture(scope="module")
def qwen3_llm(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LLM]:
    """The tiny model under a Qwen3-style template, thinking off unless a request says so."""
    model = with_chat_template(
        tiny_model_dir, tmp_path_factory.mktemp("qwen3-template") / "m", QWEN3_STYLE_TEMPLATE
    )
    llm = LLM(
        str(model), num_threads=1, max_num_seqs=16, chat_template_kwargs={"enable_thinking": False}
    )
    yield llm
    llm.shutdown()


def rendered_ids(llm: LLM, enable_thinking: bool) -> list[int]:
    return llm.tokenizer.encode_chats(
        [MESSAGES], template_kwargs={"enable_thinking": enable_thinking}
    )[0]


def test_llm_default_and_request_template_kwargs_change_the_prompt(qwen3_llm: LLM) -> None:
    params = SamplingParams(max_tokens=1)
    out = qwen3_llm.generate(
        [
            Request(messages=MESSAGES, sampling_params=params),
            Request(
                messages=MESSAGES,
                sampling_params=params,
                chat_template_kwargs={"enable_thinking": True},
            ),
            Request(messages=MESSAGES, sampling_params=params, chat_template_kwargs=["x"]),
        ]
    )
    off, on = rendered_ids(qwen3_llm, False), rendered_ids(qwen3_llm, True)
    assert off != on and len(off) > len(on)
    assert out[0].prompt_token_ids == off and out[1].prompt_token_ids == on
    assert "chat_template_kwargs must be an object" in out[2].error


def test_llm_reasoning_parser_fills_completion_reasoning(qwen3_llm: LLM) -> None:
    thinking = SamplingParams(max_tokens=40, structured=THINKING)
    truncated = SamplingParams(max_tokens=9, structured=LONG_THINKING)
    qwen3_llm.reasoning_parser = "think"
    try:
        done, cut = qwen3_llm.generate(
            [
                Request(prompt="Q", sampling_params=thinking),
                Request(prompt="Q", sampling_params=truncated),
            ]
        )
    finally:
        qwen3_llm.reasoning_parser = None
    output = done.outputs[0]
    assert output.reasoning and output.text and output.finish_reason == "stop"
    full = qwen3_llm.tokenizer.decode(output.token_ids)
    assert full == f"<think>{output.reasoning}</think> {output.text}"
    full = qwen3_llm.tokenizer.decode(cut.outputs[0].token_ids)
    assert full.startswith("<think>") and "</think>" not in full
    assert (cut.outputs[0].reasoning, cut.outputs[0].text) == (full.removeprefix("<think>"), "")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return read_jsonl(path)


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_job_template_kwargs_per_run_and_row_and_reasoning_columns(
    tmp_path: Path, qwen3_llm: LLM, output_name: str
) -> None:
    records = [
        {"messages": MESSAGES},
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        {"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": MESSAGES, "chat_template_kwargs": [False]},
        {"prompt": "Q", "guided": THINKING, "sampling_params": {"n": 2}},
        {"prompt": "Q", "guided": LONG_THINKING, "sampling_params": {"max_tokens": 9}},
    ]
    job = JobSpec(
        write_jsonl(tmp_path / "in.jsonl", records),
        tmp_path / output_name,
        model=str(qwen3_llm.model.source),
        sampling={"max_tokens": 40},
        ordered=True,
        include_token_ids=True,
        chat_template_kwargs={"enable_thinking": True},
        reasoning_parser="qwen3",
    )
    outcome = start_job(
        job, RunOptions(display="quiet"), llm_factory=lambda *a, **k: SharedLLM(qwen3_llm)
    )
    assert outcome.exit_code == 0, outcome.message
    rows = read_rows(job.output_path)
    # NOTE: the run's enable_thinking=True overrides the LLM's default; row 1's own False wins.
    assert rows[0]["prompt_tokens"] == len(rendered_ids(qwen3_llm, True))
    assert rows[1]["prompt_tokens"] == len(rendered_ids(qwen3_llm, False))
    assert "applies to chat messages" in rows[2]["error"]
    assert "chat_template_kwargs must be an object" in rows[3]["error"]
    decode = qwen3_llm.tokenizer.decode
    sampled = rows[4]
    assert sampled["text"] is None and len(sampled["reasonings"]) == 2
    for text, reasoning, ids in zip(
        sampled["texts"], sampled["reasonings"], sampled["token_ids"], strict=True
    ):
        assert reasoning and decode(ids) == f"<think>{reasoning}</think> {text}"
    cut = rows[5]
    assert cut["text"] == "" and cut["finish_reason"] == "length"
    assert "<think>" + cut["reasoning"] == decode(cut["token_ids"][0])
    options = json.loads((job_dir_for(job.output_path) / "manifest.json").read_text())["options"]
    assert options["chat_template_kwargs"] == {"enable_thinking": True}
    assert options["reasoning_parser"] == "qwen3"


def test_resume_renders_with_the_jobs_template_kwargs(tmp_path: Path, qwen3_llm: LLM) -> None:
    job = JobSpec(
        write_jsonl(tmp_path / "in.jsonl", [{"messages": MESSAGES}] * 2),
        tmp_path / "out.jsonl",
        model=str(qwen3_llm.model.source),
        sampling={"max_tokens": 1},
        chat_template_kwargs={"enable_thinking": True},
        reasoning_parser="think",
    )

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise EngineStartupError("no engine this time")

    with pytest.raises(EngineStartupError, match="Resume with"):
        start_job(job, RunOptions(display="quiet"), llm_factory=no_engine)
    outcome = resume_job(
        job.output_path, {"display": "quiet"}, llm_factory=lambda *a, **k: SharedLLM(qwen3_llm)
    )
    assert outcome.exit_code == 0, outcome.message
    # NOTE: the LLM's own default is enable_thinking=False; only the manifest says True.
    expected = len(rendered_ids(qwen3_llm, True))
    assert [row["prompt_tokens"] for row in read_jsonl(job.output_path)] == [expected] * 2
