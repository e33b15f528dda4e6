"""The `vbatch` options, each declared once with its help panel, for `run` and `resume`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from vbatch.client.reasoning import ReasoningParser
from vbatch.config import (
    AttentionBackend,
    Device,
    Dtype,
    EngineConfig,
    LinearBackend,
    Quantization,
)
from vbatch.errors import VbatchError
from vbatch.job.tasks import Task
from vbatch.sampling_params import MAX_LOGPROBS, MAX_N

INPUT = "Input"
ENGINE = "Engine"
SAMPLING = "Sampling"
STRUCTURED = "Structured output"
RAY = "Ray (many machines)"
JOB = "Job"
DISPLAY = "Display"


class Range:
    """A numeric option's parser: the one place its range is declared. A value out of range,
    not finite (nan, inf) or not written in ASCII digits fails at parse time (exit 2)."""

    def __init__(
        self,
        kind: type[int] | type[float],
        least: float,
        *,
        above: bool = False,
        most: float | None = None,
    ) -> None:
        self.kind, self.least, self.above, self.most = kind, least, above, most
        bound = f"> {least}" if above else f">= {least}"
        self.__name__ = f"{kind.__name__} {bound}" + (f", <= {most}" if most is not None else "")

    def __call__(self, value: Any) -> int | float:
        if isinstance(value, str) and not value.isascii():
            raise ValueError(f"{value!r} is not a number written in ASCII")
        number = self.kind(value)
        if not math.isfinite(number):
            raise ValueError(f"{value!r} is not a finite number")
        is_low = number <= self.least if self.above else number < self.least
        if is_low or (self.most is not None and number > self.most):
            raise ValueError(f"{value} is not {self.__name__.partition(' ')[2]}")
        return number


def count(least: int = 1, most: int | None = None) -> Range:
    return Range(int, least, most=most)


def number(least: float, *, above: bool = False, most: float | None = None) -> Range:
    return Range(float, least, above=above, most=most)


def max_errors(value: str) -> float:
    """--max-errors' parser: a count N (a whole number) or a fraction of the rows below 1."""
    limit = number(0)(value)
    if limit >= 1 and not float(limit).is_integer():
        raise ValueError(f"{value} is neither a whole number of rows nor a fraction below 1")
    return limit


def input_format(value: str) -> str:
    """--input-format's parser: a format `--help` lists, else a usage error (exit 2)."""
    from vbatch.job.reader import INPUT_FORMATS

    if value not in INPUT_FORMATS:
        raise ValueError(f"{value!r} is not one of {', '.join(INPUT_FORMATS)}")
    return value


def file_path(value: str) -> Path:
    """A job output's parser: a path that names a file, else a usage error (exit 2); a symlink
    there is followed (job/paths.py `through_link`)."""
    from vbatch.job.paths import through_link

    path = Path(value)
    if not path.name or path.name == "..":
        raise ValueError(f"{value!r} names no file: give the output file's path, e.g. out.jsonl")
    return through_link(path)


def shard(value: str) -> str:
    """--shard's parser: I/N checked now (exit 2); auto needs the job array's environment, read
    when the job starts."""
    from vbatch.job.shard import parse_shard

    if not value.startswith("auto"):
        try:
            parse_shard(value)
        except VbatchError as e:
            raise ValueError(str(e)) from None
    return value


def stop_string(value: str) -> str:
    """--stop's parser: an empty stop string is a usage error (exit 2)."""
    if not value:
        raise ValueError("a stop string must not be empty")
    return value


INT64 = Range(int, -(2**63), most=2**63 - 1)

InputPath = Annotated[Path, typer.Argument(help="Input file: .jsonl[.gz|.zst] or .parquet.")]
OutputPath = Annotated[
    Path,
    typer.Option("--output", "-o", help="Output: .jsonl or .parquet.", parser=file_path),
]
JobOutput = Annotated[
    Path,
    typer.Argument(
        help="The output path the job was started with; for a shard's file "
        "(out.shard-I-of-N.parquet) with no job yet, starts that shard like the others.",
        parser=file_path,
    ),
]

ServedModelNames = Annotated[
    list[str] | None,
    typer.Option(
        "--served-model-name",
        help="A name an OpenAI line's body.model may give for the model (repeatable), "
        "besides its path, file name and hub id.",
        rich_help_panel=INPUT,
    ),
]
InputFormat = Annotated[
    str | None,
    typer.Option(
        help="jsonl or parquet (default: by extension).", rich_help_panel=INPUT, parser=input_format
    ),
]
PromptColumn = Annotated[
    str | None,
    typer.Option(help="Column holding the prompt (default: prompt).", rich_help_panel=INPUT),
]
MessagesColumn = Annotated[
    str | None,
    typer.Option(help="Column holding chat messages (default: messages).", rich_help_panel=INPUT),
]
IdColumn = Annotated[
    str | None,
    typer.Option(
        help="Id column (default: id, custom_id, else the row index).", rich_help_panel=INPUT
    ),
]
KeepColumns = Annotated[
    str | None,
    typer.Option(help="Comma-separated input columns to copy.", rich_help_panel=INPUT),
]
KeepAllColumns = Annotated[
    bool,
    typer.Option(
        "--keep-all-columns", help="Copy every input column to the output.", rich_help_panel=INPUT
    ),
]

LORA = "LoRA adapters"
Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="NAME=PATH",
        help="A PEFT LoRA adapter directory (repeatable); a row picks one by name.",
        rich_help_panel=LORA,
    ),
]
LoraDefault = Annotated[
    str | None,
    typer.Option(
        help="The adapter of rows that name none (default: the base model).", rich_help_panel=LORA
    ),
]
LoraColumn = Annotated[
    str | None,
    typer.Option(
        help="Column that names the adapter of a row (default: lora; OpenAI lines: body.model).",
        rich_help_panel=LORA,
    ),
]
MaxLoras = Annotated[
    int,
    typer.Option(
        help="Adapters held on the device at once.", rich_help_panel=LORA, parser=count(1)
    ),
]
MaxLoraRank = Annotated[
    int, typer.Option(help="The largest adapter rank.", rich_help_panel=LORA, parser=count(1))
]

Model = Annotated[
    str | None,
    typer.Option(
        help="HF model directory, hub id in the local Hugging Face cache (org/name or "
        "org/name@revision, never downloaded) or .gguf file (default: the bundled "
        "SmolLM2-135M-Instruct).",
        rich_help_panel=ENGINE,
    ),
]
DeviceOption = Annotated[
    Device,
    typer.Option("--device", help="auto picks cuda when present.", rich_help_panel=ENGINE),
]
DtypeOption = Annotated[
    Dtype,
    typer.Option(
        "--dtype",
        help="auto is float32 on CPU, bfloat16 (or float16) on CUDA.",
        rich_help_panel=ENGINE,
    ),
]
MaxNumSeqs = Annotated[
    int,
    typer.Option(help="Most sequences in one batch.", rich_help_panel=ENGINE, parser=count()),
]
MaxNumBatchedTokens = Annotated[
    int,
    typer.Option(
        help="Token budget of one engine step (at least the KV block size, 16).",
        rich_help_panel=ENGINE,
        parser=count(EngineConfig.block_size),
    ),
]
MaxModelLen = Annotated[
    int | None,
    typer.Option(
        help="Longest prompt + output, in tokens (default: the model's).",
        rich_help_panel=ENGINE,
        parser=count(),
    ),
]
GpuMemoryUtilization = Annotated[
    float,
    typer.Option(
        "--gpu-memory-utilization",
        help="Share of the GPU's memory the model and KV cache may take (CUDA).",
        rich_help_panel=ENGINE,
        parser=number(0, above=True, most=1),
    ),
]
KvCacheMemory = Annotated[
    float | None,
    typer.Option(
        "--kv-cache-memory",
        help="KV cache size in GB.",
        rich_help_panel=ENGINE,
        parser=number(0, above=True),
    ),
]
AttentionBackendOption = Annotated[
    AttentionBackend,
    typer.Option(
        "--attention-backend",
        help="auto uses the native kernels where they build, else torch.",
        rich_help_panel=ENGINE,
    ),
]
NumThreads = Annotated[
    int | None,
    typer.Option(help="CPU threads for the engine.", rich_help_panel=ENGINE, parser=count()),
]
KvCacheDtype = Annotated[
    Dtype,
    typer.Option(
        "--kv-cache-dtype",
        help="auto is the model dtype. A 16-bit cache under a float32 model (CPU) halves KV "
        "memory and traffic at a small accuracy cost.",
        rich_help_panel=ENGINE,
    ),
]
DataParallelSize = Annotated[
    int | None,
    typer.Option(
        "--data-parallel-size",
        "-dp",
        help="Engine cores on this machine, each a full engine: one per GPU, or on CPU each "
        "with its share of --num-threads (the total) pinned to its own CPUs. Rows go to the "
        "least loaded.",
        rich_help_panel=ENGINE,
        parser=count(),
    ),
]
UseRay = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Run the engines as Ray actors (needs `pip install 'vbatch\\[ray]'`).",
        rich_help_panel=RAY,
    ),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        help="The Ray cluster to join, HOST:PORT or auto (checked to answer first; default: "
        "RAY_ADDRESS, else a new local cluster that stops with the job); on resume of a --ray "
        "job, the one to join this time.",
        rich_help_panel=RAY,
    ),
]
Replicas = Annotated[
    int, typer.Option(help="Engine replicas (Ray actors).", rich_help_panel=RAY, parser=count())
]
GpusPerReplica = Annotated[
    float,
    typer.Option(help="GPUs Ray gives each replica.", rich_help_panel=RAY, parser=number(0)),
]
CpusPerReplica = Annotated[
    float,
    typer.Option(
        help="CPUs Ray gives each replica; also its engine's threads.",
        rich_help_panel=RAY,
        parser=number(0, above=True),
    ),
]
MaxRestarts = Annotated[
    int,
    typer.Option(
        help="Times Ray may restart each replica that died.",
        rich_help_panel=RAY,
        parser=count(0),
    ),
]
ChatTemplateKwargs = Annotated[
    str | None,
    typer.Option(
        help="Chat-template variables as a JSON object, e.g. enable_thinking (a row's own "
        "chat_template_kwargs are merged over them).",
        rich_help_panel=INPUT,
    ),
]
ReasoningParserOption = Annotated[
    ReasoningParser | None,
    typer.Option(
        "--reasoning-parser",
        help="Move the reasoning part (in think tags) of each output to a `reasoning` column.",
        rich_help_panel=STRUCTURED,
    ),
]
QuantizationOption = Annotated[
    Quantization | None,
    typer.Option(
        "--quantization",
        help="int8: int8 weights and activations in the decoder's linears (CPU).",
        rich_help_panel=ENGINE,
    ),
]
EnforceEager = Annotated[
    bool,
    typer.Option(
        "--enforce-eager",
        help="On CUDA, run decode eagerly instead of replaying CUDA graphs.",
        rich_help_panel=ENGINE,
    ),
]
MaxGraphBatchSize = Annotated[
    int,
    typer.Option(
        help="Largest decode batch captured as a CUDA graph.",
        rich_help_panel=ENGINE,
        parser=count(),
    ),
]
AsyncScheduling = Annotated[
    bool,
    typer.Option(
        "--async-scheduling",
        help="Launch each decode step before the last one's tokens reach the host, so a "
        "GPU computes it while they are applied (same tokens; nothing to gain on CPU).",
        rich_help_panel=ENGINE,
    ),
]
BatchInvariant = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="Compute every row of a step as in any other batch (CPU, float32): a seeded row "
        "gives the same tokens alone, in any batch and after a prefix-cache hit. Slower; "
        "without int8, LoRA, MoE models or the greedy screen.",
        rich_help_panel=ENGINE,
    ),
]
GreedyScreen = Annotated[
    bool | None,
    typer.Option(
        "--greedy-screen/--no-greedy-screen",
        help="On CPU, screen the vocabulary in int8 before scoring greedy tokens in fp32 (the "
        "same tokens); off scores the whole vocabulary in fp32. Default: whichever is faster "
        "on this CPU at the step's batch size, timed at batch 1, 4, 16 and 64 at start-up and "
        "cached.",
        rich_help_panel=ENGINE,
    ),
]
LinearBackendOption = Annotated[
    LinearBackend,
    typer.Option(
        "--linear-backend",
        help="GEMM of the float32 CPU linears and LM head: torch's (MKL), oneDNN's or vbatch's "
        "native packed kernel. auto: the fastest per projection and row count, timed at "
        "start-up and cached.",
        rich_help_panel=ENGINE,
    ),
]
HeartbeatTimeout = Annotated[
    float,
    typer.Option(
        "--heartbeat-timeout",
        help="Seconds without a heartbeat from the engine core, or in one engine step that "
        "does not use the CPU, before the core counts as hung: it is killed and the job commits "
        "and exits with the resume command. A step that computes may run longer, up to a limit "
        "sized from the step times measured so far.",
        rich_help_panel=ENGINE,
        parser=number(1),
    ),
]

MaxTokens = Annotated[
    int,
    typer.Option(help="Most generated tokens per row.", rich_help_panel=SAMPLING, parser=count()),
]
Temperature = Annotated[
    float,
    typer.Option(help="0 means greedy (reproducible).", rich_help_panel=SAMPLING, parser=number(0)),
]
TopP = Annotated[
    float, typer.Option(rich_help_panel=SAMPLING, parser=number(0, above=True, most=1))
]
TopK = Annotated[int, typer.Option(help="0 disables.", rich_help_panel=SAMPLING, parser=count(-1))]
MinP = Annotated[float, typer.Option(rich_help_panel=SAMPLING, parser=number(0, most=1))]
Seed = Annotated[
    int | None,
    typer.Option(
        help="Seed for sampled rows (reproducible).", rich_help_panel=SAMPLING, parser=INT64
    ),
]
Stop = Annotated[
    list[str] | None,
    typer.Option(help="Stop string (repeatable).", rich_help_panel=SAMPLING, parser=stop_string),
]
N = Annotated[
    int,
    typer.Option(
        help="Samples per row (at most 256).", rich_help_panel=SAMPLING, parser=count(1, MAX_N)
    ),
]
Logprobs = Annotated[
    int | None,
    typer.Option(
        help="Top logprobs per token (0-20).",
        rich_help_panel=SAMPLING,
        parser=count(0, MAX_LOGPROBS),
    ),
]
IncludeTokenIds = Annotated[
    bool,
    typer.Option("--include-token-ids", help="Add output token ids.", rich_help_panel=SAMPLING),
]

JsonSchema = Annotated[
    Path | None,
    typer.Option(
        "--json-schema",
        help="Every row's output is JSON valid against this JSON schema file.",
        rich_help_panel=STRUCTURED,
    ),
]
Regex = Annotated[
    str | None,
    typer.Option(help="Every row's output matches this regex.", rich_help_panel=STRUCTURED),
]
Choice = Annotated[
    str | None,
    typer.Option(
        help="Every row's output is one of these comma-separated labels.",
        rich_help_panel=STRUCTURED,
    ),
]
Grammar = Annotated[
    Path | None,
    typer.Option(
        help="Every row's output follows this EBNF grammar file (rule `root`).",
        rich_help_panel=STRUCTURED,
    ),
]
TaskOption = Annotated[
    Task,
    typer.Option(
        "--task",
        help="generate: text; embed: an `embedding` per row; classify: the classifier's label, "
        "probs and logits; perplexity: the prompt's logprob and perplexity (per token with "
        "--include-token-ids).",
        rich_help_panel=JOB,
    ),
]
Dimensions = Annotated[
    int | None,
    typer.Option(
        "--dimensions",
        min=1,
        help="With --task embed: keep the leading N values of each embedding (Matryoshka).",
        rich_help_panel=JOB,
    ),
]
ParseJson = Annotated[
    bool,
    typer.Option(
        "--parse-json", help="Add a `json` column: the parsed output.", rich_help_panel=STRUCTURED
    ),
]
RequireValidJson = Annotated[
    bool,
    typer.Option(
        "--require-valid-json",
        help="A JSON output that does not validate against its schema is an error row "
        "(without it, its `structured_valid` is false).",
        rich_help_panel=STRUCTURED,
    ),
]

Ordered = Annotated[
    bool,
    typer.Option("--ordered", help="Sort the final output by input index.", rich_help_panel=JOB),
]
Overwrite = Annotated[
    bool,
    typer.Option("--overwrite", help="Replace an existing output and job.", rich_help_panel=JOB),
]
Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Resume even if the input, model or vbatch version changed.",
        rich_help_panel=JOB,
    ),
]
RetryErrors = Annotated[
    bool,
    typer.Option(
        "--retry-errors", help="Run the rows that ended in error again.", rich_help_panel=JOB
    ),
]
Clean = Annotated[
    bool,
    typer.Option("--clean", help="Remove the job directory on success.", rich_help_panel=JOB),
]
CommitEveryRows = Annotated[
    int | None,
    typer.Option(help="Commit after this many finished rows.", rich_help_panel=JOB, parser=count()),
]
CommitEverySeconds = Annotated[
    float | None,
    typer.Option(help="Commit at least this often.", rich_help_panel=JOB, parser=number(0)),
]
MaxErrors = Annotated[
    float | None,
    typer.Option(
        help="Stop when more rows error (N, or a fraction < 1).",
        rich_help_panel=JOB,
        parser=max_errors,
    ),
]
DrainTimeout = Annotated[
    float | None,
    typer.Option(
        "--drain-timeout",
        help="Seconds in-flight rows get on SIGTERM/SIGINT.",
        rich_help_panel=JOB,
        parser=number(0),
    ),
]
MaxInFlight = Annotated[
    int | None,
    typer.Option(help="Most rows admitted at once.", rich_help_panel=JOB, parser=count()),
]
ShardOption = Annotated[
    str | None,
    typer.Option(
        "--shard",
        help="Run one shard of a job array: I/N (0 <= I < N <= 100000) takes the rows whose id "
        "hashes to I and writes them, for -o out.parquet, to out.shard-I-of-N.parquet (its own "
        "job). auto reads SLURM_ARRAY_TASK_ID/COUNT (a range array; a list "
        "array needs I/N), or JOB_COMPLETION_INDEX plus VBATCH_SHARD_COUNT; auto/N sets N. "
        "Join the shards with `vbatch merge OUTPUT`.",
        rich_help_panel=JOB,
        parser=shard,
    ),
]

Quiet = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print nothing but errors and warnings (and how to resume an interrupted job).",
        rich_help_panel=DISPLAY,
    ),
]
LogInterval = Annotated[
    float,
    typer.Option(
        "--log-interval",
        help="Seconds between plain progress lines.",
        rich_help_panel=DISPLAY,
        parser=number(0, above=True),
    ),
]
MetricsFile = Annotated[
    Path | None,
    typer.Option(help="Keep live job metrics in this JSON file.", rich_help_panel=DISPLAY),
]
