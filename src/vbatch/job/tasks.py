"""A job's task (`--task generate|embed|classify|perplexity`): the pooling params a row runs
with, the output row of an embedding, classification or perplexity result, its Parquet schema,
and the OpenAI `/v1/embeddings` request body and response line."""

from __future__ import annotations

import base64
import enum
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vbatch.models.config import HEAD_NAMES
from vbatch.pooling_params import PoolingParams, PoolingTask

if TYPE_CHECKING:
    import pyarrow as pa

    from vbatch.client.pooling_outputs import PoolingRequestOutput
    from vbatch.job.rows import InputRow


class Task(str, enum.Enum):
    GENERATE = "generate"
    EMBED = "embed"
    CLASSIFY = "classify"
    PERPLEXITY = "perplexity"


_POOLING_TASKS = {
    Task.EMBED: PoolingTask.EMBED,
    Task.CLASSIFY: PoolingTask.CLASSIFY,
    Task.PERPLEXITY: PoolingTask.PROMPT_LOGPROBS,
}
# NOTE: the columns of each pooling task, in order; `embeddings` (a list input's) and the
# per-token ones are left out of JSONL lines when null.
TASK_COLUMNS = {
    Task.EMBED: ("embedding", "embeddings", "dimension"),
    Task.CLASSIFY: ("label", "probs", "logits"),
    Task.PERPLEXITY: ("logprob", "perplexity", "scored_tokens", "token_ids", "token_logprobs"),
}
COMMON_COLUMNS = ("prompt_tokens", "finish_reason", "latency_s", "error")
OPTIONAL_TASK_COLUMNS = frozenset({"embeddings", "token_ids", "token_logprobs"})
ENCODING_FORMATS = ("float", "base64")
# NOTE: body keys of an embeddings request that do not change the result.
_EMBEDDINGS_IGNORED = frozenset({"model", "user"})


def pooling_params(task: str, dimensions: int | None) -> PoolingParams | None:
    """What every plain row of a `task` job runs with; None for generation."""
    kind = _POOLING_TASKS.get(Task(task))
    if kind is None:
        return None
    return PoolingParams(kind, dimensions=dimensions if kind == PoolingTask.EMBED else None)


def head_problem(task: str, head: str) -> str | None:
    """Why every row of a `task` job would fail on a model whose head (ModelConfig.head) is
    `head`, or None. A generation job may still hold embeddings lines, so it is not judged
    here."""
    has = HEAD_NAMES.get(head, repr(head))
    if Task(task) == Task.CLASSIFY and head != "score":
        return f"--task classify needs a *ForSequenceClassification model; this one has {has}"
    if Task(task) == Task.PERPLEXITY and head != "lm":
        return f"--task perplexity needs a model with an LM head; this one has {has}"
    return None


def task_columns(task: str) -> tuple[str, ...]:
    return ("id", "index", *TASK_COLUMNS[Task(task)], *COMMON_COLUMNS)


def pooled_row(
    row: InputRow,
    result: PoolingRequestOutput,
    task: str,
    labels: dict[int, str],
    include_tokens: bool,
    problem_type: str | None = None,
) -> dict[str, Any]:
    """The output row of a finished pooling request of a `task` job (`problem_type`: the
    classifier's, see class_probs)."""
    import numpy as np

    if result.error is not None:
        return pooled_error_row(
            row, task, f"{row.location}: {result.error}", len(result.prompt_token_ids)
        )
    values = dict.fromkeys(task_columns(task))
    data = result.outputs.data
    values.update(
        id=row.id,
        index=row.index,
        prompt_tokens=len(result.prompt_token_ids),
        finish_reason="stop",
        latency_s=None
        if result.finish_time is None
        else round(result.finish_time - result.arrival_time, 6),
    )
    if Task(task) == Task.EMBED:
        if data.ndim == 2:
            # NOTE: a list of rows: pyarrow takes no 2-D array for list<fixed_size_list>.
            values["embeddings"] = list(data)
        else:
            values["embedding"] = data
        values["dimension"] = int(data.shape[-1])
    elif Task(task) == Task.CLASSIFY:
        from vbatch.client.pooling_outputs import class_probs

        probs = class_probs(data, problem_type).astype(np.float32)
        values.update(probs=probs, logits=data, label=labels.get(int(np.argmax(probs))))
    else:
        from vbatch.client.pooling_outputs import perplexity_of

        total, perplexity = perplexity_of(data)
        values.update(
            logprob=total,
            perplexity=None if math.isnan(perplexity) else perplexity,
            scored_tokens=int(data.size),
        )
        if include_tokens:
            values.update(token_ids=list(result.prompt_token_ids), token_logprobs=data)
    return values


def pooled_error_row(
    row: InputRow, task: str, message: str, prompt_tokens: int = 0
) -> dict[str, Any]:
    values = dict.fromkeys(task_columns(task))
    values.update(
        id=row.id,
        index=row.index,
        prompt_tokens=prompt_tokens,
        finish_reason="error",
        error=message,
    )
    return values


def task_schema(
    task: str, id_kind: str, dimension: int | None, kept_fields: list[pa.Field]
) -> pa.Schema:
    """The Parquet schema of a pooling job: `embedding` is fixed_size_list<float32>[dimension]."""
    import pyarrow as pa

    vector = pa.list_(pa.float32(), dimension) if dimension else pa.list_(pa.float32())
    types = {
        "id": pa.int64() if id_kind == "int" else pa.string(),
        "index": pa.int64(),
        "embedding": vector,
        "embeddings": pa.list_(vector),
        "dimension": pa.int64(),
        "label": pa.string(),
        "probs": pa.list_(pa.float32()),
        "logits": pa.list_(pa.float32()),
        "logprob": pa.float64(),
        "perplexity": pa.float64(),
        "scored_tokens": pa.int64(),
        "token_ids": pa.list_(pa.int32()),
        "token_logprobs": pa.list_(pa.float32()),
        "prompt_tokens": pa.int64(),
        "finish_reason": pa.string(),
        "latency_s": pa.float64(),
        "error": pa.string(),
    }
    return pa.schema([pa.field(name, types[name]) for name in task_columns(task)] + kept_fields)


def embedding_dimension(hf_dir: Path, dimensions: int | None) -> int | None:
    """The width of a job's embeddings: `--dimensions`, else the model's hidden size."""
    if dimensions is not None:
        return dimensions
    try:
        return int(json.loads((hf_dir / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def embeddings_request(body: dict[str, Any]) -> tuple[str | list[str], PoolingParams, str]:
    """(input, pooling params, encoding_format) of an OpenAI embeddings request body; raises
    ValueError naming the bad field."""
    unknown = sorted(set(body) - {"input", "dimensions", "encoding_format"} - _EMBEDDINGS_IGNORED)
    if unknown:
        raise ValueError(f"unsupported body field {unknown[0]!r}")
    text = body.get("input")
    is_texts = isinstance(text, list) and text and all(isinstance(t, str) and t for t in text)
    if not is_texts and (not isinstance(text, str) or not text):
        raise ValueError("body.input must be a non-empty string or a list of non-empty strings")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise ValueError(f"body.encoding_format must be float or base64, got {encoding!r:.40}")
    return text, PoolingParams(PoolingTask.EMBED, dimensions=body.get("dimensions")), encoding


def openai_embeddings_body(
    row: InputRow, values: dict[str, Any], model_name: str
) -> dict[str, Any]:
    """OpenAI's embeddings response body for a finished embeddings row (or a plain row of a
    --task embed job)."""
    import numpy as np

    listed = values.get("embeddings")
    vectors = listed if listed is not None else [values["embedding"]]
    as_base64 = row.encoding_format == "base64"
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
            if as_base64
            else np.asarray(v, np.float32).tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    tokens = values["prompt_tokens"]
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
