"""Tests for input row parsing: prompt, messages, OpenAI Batch lines, overrides, row errors."""

from __future__ import annotations

from typing import Any

import pytest

from vbatch.job.rows import ColumnOptions, RowError, RowParser, openai_overrides
from vbatch.sampling_params import SamplingParams

DEFAULTS = SamplingParams(max_tokens=32, temperature=0.0)

CHAT = [{"role": "user", "content": "x"}]


def parse(record: Any, options: ColumnOptions | None = None, index: int = 7) -> Any:
    return RowParser(options or ColumnOptions(), DEFAULTS).parse(record, index, "line 9")


def test_prompt_row_uses_the_index_as_id_and_default_params() -> None:
    row = parse({"prompt": "hello"})
    assert (row.id, row.index, row.prompt, row.messages, row.error) == (7, 7, "hello", None, None)
    assert row.sampling_params is None


def test_messages_row_and_per_row_overrides() -> None:
    messages = [{"role": "user", "content": "hi"}]
    row = parse({"id": "a", "messages": messages, "sampling_params": {"max_tokens": 4, "seed": 3}})
    assert row.id == "a" and row.messages == messages
    assert row.sampling_params.max_tokens == 4 and row.sampling_params.seed == 3
    assert row.sampling_params.temperature == 0.0


def test_chat_template_kwargs_per_row_merge_over_the_runs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    parser = RowParser(ColumnOptions(), DEFAULTS, {"enable_thinking": False, "style": "short"})
    row = parser.parse({"messages": messages, "chat_template_kwargs": {"style": "long"}}, 0, "l1")
    assert row.chat_template_kwargs == {"enable_thinking": False, "style": "long"}
    assert parser.parse({"messages": messages}, 1, "l2").chat_template_kwargs == {
        "enable_thinking": False,
        "style": "short",
    }
    assert parser.parse({"prompt": "x"}, 2, "l3").chat_template_kwargs is None
    record = {"custom_id": "c", "body": {"messages": messages, "chat_template_kwargs": {"a": 1}}}
    assert parse(record).chat_template_kwargs == {"a": 1}
    # NOTE: as a Parquet column, JSON text or a struct whose absent fields are null.
    text = {"messages": messages, "chat_template_kwargs": '{"enable_thinking": true}'}
    assert parse(text).chat_template_kwargs == {"enable_thinking": True}
    struct = {"messages": messages, "chat_template_kwargs": {"enable_thinking": None, "b": 2}}
    assert parse(struct).chat_template_kwargs == {"b": 2}
    assert parse({"messages": messages}).chat_template_kwargs is None


def test_custom_columns() -> None:
    options = ColumnOptions(prompt_column="q", id_column="key", keep_columns=("extra",))
    row = parse({"q": "why", "key": 12, "extra": [1, 2]}, options)
    assert (row.prompt, row.id, row.kept) == ("why", 12, {"extra": [1, 2]})


def test_openai_chat_line_maps_body_fields() -> None:
    record = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "temperature": 0.5,
            "stop": "\n",
            "logprobs": True,
            "top_logprobs": 2,
        },
    }
    row = parse(record)
    params = row.sampling_params
    assert row.id == "req-1" and row.openai_kind == "chat"
    assert (params.max_tokens, params.temperature, params.stop, params.logprobs) == (
        5,
        0.5,
        ["\n"],
        2,
    )


@pytest.mark.parametrize("text", [" ", "\n", "\t "])
def test_a_whitespace_prompt_is_a_prompt(text: str) -> None:
    """It tokenizes to real tokens (vLLM and sentence-transformers take it); before, a job made
    it an error row saying the prompt was empty."""
    row = parse({"prompt": text})
    assert row.error is None and row.prompt == text


def test_an_openai_line_s_id_is_its_custom_id_whatever_other_keys_it_has() -> None:
    """Before, a top-level `id` beside it won, and the response carried that as its custom_id."""
    body = {"prompt": "x"}
    line = {"id": 1, "custom_id": "req-A", "url": "/v1/completions", "body": body}
    assert parse(line).id == "req-A"
    assert parse({"id": 1, "custom_id": "req-A", "prompt": "x"}).id == 1


def test_openai_completions_line() -> None:
    record = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 1}}
    row = parse(record)
    assert row.openai_kind == "completions" and row.prompt == "x"
    assert row.sampling_params.logprobs == 1


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([1, 2], "line 9: expected a JSON object, got list"),
        ({"text": "x"}, "line 9: missing prompt"),
        ({"prompt": ""}, "line 9: prompt is empty"),
        ({"prompt": 5}, "line 9: prompt must be a string, got int"),
        ({"messages": "hi"}, "line 9: messages must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, "line 9: messages[0] must have a string 'role'"),
        ({"prompt": "x", "messages": CHAT}, "row has both"),
        ({"prompt": "x", "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"prompt": "x", "sampling_params": {"max_tokens": "9"}}, "max_tokens must be an integer"),
        ({"prompt": "x", "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
        ({"prompt": "x", "sampling_params": [1]}, "sampling_params must be an object"),
        (
            {"prompt": "x", "sampling_params": {"prompt_logprobs": 1}},
            "prompt_logprobs is not written by jobs; a --task perplexity job scores every",
        ),
        ({"prompt": "x", "id": 1.5}, "id column 'id' must hold a string or an integer, got 1.5"),
        ({"prompt": "x", "custom_id": 1.5}, "id column 'custom_id' must hold a string or an"),
        ({"custom_id": "a", "url": "/v1/moderations", "body": {}}, "url must be one of"),
        ({"custom_id": "a", "body": {"prompt": "x"}}, "the line has no url, so it is read as"),
        ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "body.input must be"),
        (
            {"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 0}},
            "dimensions must be a positive integer",
        ),
        ({"custom_id": "a", "url": "/v1/completions", "method": "GET", "body": {}}, "POST"),
        (
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "tools": []}},
            "unsupported body field 'tools'",
        ),
        ({"custom_id": "a", "body": {"messages": []}}, "body.messages must be a non-empty list"),
        (
            {"custom_id": "a", "body": {"messages": CHAT, "n": 0}},
            "n must be at",
        ),
        (
            {
                "messages": CHAT,
                "chat_template_kwargs": ["enable_thinking"],
            },
            "chat_template_kwargs must be an object of template variables",
        ),
        (
            {
                "messages": CHAT,
                "chat_template_kwargs": "{enable_thinking",
            },
            "chat_template_kwargs is not valid JSON",
        ),
        (
            {
                "messages": CHAT,
                "chat_template_kwargs": {"messages": []},
            },
            "chat_template_kwargs may not set 'messages'",
        ),
        (
            {"messages": CHAT, "chat_template_kwargs": {"chat_template": "X"}},
            "chat_template_kwargs may not set 'chat_template'",
        ),
        (
            {"messages": CHAT, "chat_template_kwargs": {"a-b": 1}},
            "not a template variable name",
        ),
        (
            {"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs applies to chat messages, and this row has a prompt",
        ),
        (
            {
                "custom_id": "a",
                "body": {"messages": CHAT, "chat_template_kwargs": 1},
            },
            "body.chat_template_kwargs must be an object",
        ),
    ],
)
def test_bad_rows_become_error_rows(record: Any, message: str) -> None:
    row = parse(record)
    assert row.error is not None and message in row.error
    assert row.error.startswith("line 9: ")
    assert row.prompt is None and row.messages is None and row.index == 7
    assert row.chat_template_kwargs is None


def test_null_fields_are_absent_in_sampling_params_and_openai_bodies() -> None:
    row = parse({"prompt": "x", "sampling_params": {"max_tokens": 4, "temperature": None}})
    assert row.error is None and (
        row.sampling_params.max_tokens,
        row.sampling_params.temperature,
    ) == (
        4,
        0.0,
    )
    body = {"prompt": "x", "temperature": None, "logprobs": None, "tools": None, "n": None}
    row = parse({"custom_id": "c", "url": "/v1/completions", "body": body})
    assert row.error is None and row.sampling_params == DEFAULTS


def test_openai_fields_without_effect_are_accepted_and_logit_bias_and_echo_are_mapped() -> None:
    body = {
        "prompt": "x",
        "service_tier": "auto",
        "store": False,
        "metadata": {"a": "b"},
        "user": "u",
        "parallel_tool_calls": True,
        "stream_options": {"include_usage": True},
        "echo": True,
    }
    row = parse({"custom_id": "c", "url": "/v1/completions", "body": body})
    assert row.error is None and row.echo
    assert openai_overrides({"logit_bias": {"50256": -100, 7: 2.5}}, "chat") == {
        "logit_bias": {50256: -100.0, 7: 2.5}
    }
    # NOTE: as vLLM's server, a bias past [-100, 100] is clamped.
    assert openai_overrides({"logit_bias": {"5": 150, 6: -1e400, 7: 10**400}}, "chat") == {
        "logit_bias": {5: 100.0, 6: -100.0, 7: 100.0}
    }
    for bad in ({"x": 1}, {"5": float("nan")}, {"5": True}, [1]):
        with pytest.raises(RowError, match="logit_bias"):
            openai_overrides({"logit_bias": bad}, "chat")
    # NOTE: max_completion_tokens wins over the deprecated max_tokens, in either order.
    for body in (
        {"max_tokens": 6, "max_completion_tokens": 2},
        {"max_completion_tokens": 2, "max_tokens": 6},
    ):
        assert openai_overrides(body, "chat") == {"max_tokens": 2}
    for body, message in (
        ({"messages": CHAT, "echo": True}, "echo is a /v1/completions field"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo with logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo must be true or false"),
        ({"messages": CHAT, "logprobs": False, "top_logprobs": 3}, "needs logprobs: true"),
        ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs needs logprobs: true"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 25}, "top_logprobs must be an"),
        ({"messages": CHAT, "logprobs": 2}, "logprobs must be true or false"),
        # NOTE: before, it silently set logprobs, or not, by its place in the body.
        ({"prompt": "x", "top_logprobs": 3}, "top_logprobs is a /v1/chat/completions field"),
    ):
        url = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        row = parse({"custom_id": "c", "url": url, "body": body})
        assert row.error is not None and message in row.error, row.error


def test_openai_lines_get_their_own_defaults_and_must_name_the_jobs_model() -> None:
    openai = DEFAULTS.updated({"temperature": 1.0, "top_p": 1.0})
    parser = RowParser(
        ColumnOptions(), DEFAULTS, model_names=frozenset({"tiny"}), openai_defaults=openai
    )
    line = {"custom_id": "c", "body": {"messages": CHAT, "model": "tiny", "top_p": 0.5}}
    params = parser.parse(line, 0, "line 1").sampling_params
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.5, 32)
    assert parser.parse({"prompt": "x"}, 1, "line 2").sampling_params is None
    line = {"custom_id": "d", "body": {"messages": CHAT, "model": "gpt-4o"}}
    error = parser.parse(line, 2, "line 3").error
    assert (
        error
        == "line 3: body.model 'gpt-4o' is not this job's model; give one of 'tiny', or no model"
    )


def test_responses_lines_are_error_rows_naming_the_supported_urls() -> None:
    row = parse({"custom_id": "r", "url": "/v1/responses", "body": {"input": "x"}})
    assert row.error is not None and "/v1/chat/completions" in row.error
    assert "/v1/responses" in row.error


@pytest.mark.parametrize(("value", "has_hint"), [(3.0, True), (1.5, False), (None, False)])
def test_an_integral_float_id_says_where_it_comes_from(value: float | None, has_hint: bool) -> None:
    row = RowParser(ColumnOptions(), SamplingParams()).parse(
        {"prompt": "x", "id": value}, 0, "row 1"
    )
    assert row.id is None and row.error is not None
    assert ("pandas stores integer ids as float64" in row.error) == has_hint, row.error


def test_sampling_settings_beside_the_prompt_are_warned_of_once_and_not_applied() -> None:
    """`{"prompt": ..., "max_tokens": 50}` reads naturally but a job reads a row's settings only
    under `sampling_params`: the first such row is named once, and the settings stay unread."""
    warnings: list[str] = []
    parser = RowParser(ColumnOptions(keep_columns=("seed",)), DEFAULTS)
    parser.warn = warnings.append
    quiet = parser.parse({"prompt": "a", "sampling_params": {"max_tokens": 3}, "seed": 5}, 0, "l1")
    assert warnings == [] and quiet.sampling_params.max_tokens == 3
    stray = parser.parse({"prompt": "b", "max_tokens": 50, "temperature": 0.7}, 1, "line 2")
    assert stray.sampling_params is None and stray.error is None
    parser.parse({"prompt": "c", "top_p": 0.5}, 2, "line 3")
    (message,) = warnings
    assert message.startswith("warning: line 2 holds max_tokens, temperature beside its prompt")
    assert '{"sampling_params": {"max_tokens": ...}}' in message
    named = RowParser(ColumnOptions(prompt_column="stop"), DEFAULTS)
    named.warn = warnings.append
    assert named.parse({"stop": "a prompt"}, 0, "line 1").prompt == "a prompt"
    assert len(warnings) == 1
    openai = RowParser(ColumnOptions(), DEFAULTS)
    openai.warn = warnings.append
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}
    assert openai.parse(line, 0, "line 1").sampling_params.max_tokens == 4
    assert len(warnings) == 1
