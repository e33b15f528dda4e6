"""Every msgspec message that crosses the client/engine-core process boundary."""

from __future__ import annotations

import enum
import re

import msgspec
import numpy as np

from vbatch.lora.request import LoraRef
from vbatch.pooling_params import PoolingParams
from vbatch.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


def pack_token_ids(token_ids: list[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes: 4 bytes a token instead of a msgpack list."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


class AddRequest(_Msg, tag=1):
    request_id: str
    prompt_token_ids: bytes
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    # NOTE: set for a prefill-only request: the core answers with a PooledOutput, not tokens.
    pooling: PoolingParams | None = None
    lora: LoraRef | None = None
    # NOTE: vLLM's cache_salt: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = None


class Abort(_Msg, tag=2):
    """End every unfinished sample of `request_ids`; with `indices` (aligned with request_ids),
    only sample `indices[j]` of request `request_ids[j]`."""

    request_ids: list[str]
    indices: list[int] | None = None


class Utility(_Msg, tag=3):
    call_id: int
    method: str


class Shutdown(_Msg, tag=4):
    pass


ClientMessage = AddRequest | Abort | Utility | Shutdown


def undecodable_target(data: bytes | memoryview) -> tuple[type, str | int] | None:
    """Whom the core can answer about a client message it could not decode: (AddRequest,
    request_id) or (Utility, call_id), read from the raw msgpack array; None when neither."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    if not isinstance(raw, list) or len(raw) < 2:
        return None
    tag, key = raw[0], raw[1]
    if tag == AddRequest.__struct_config__.tag and isinstance(key, str):
        return AddRequest, key
    if tag == Utility.__struct_config__.tag and type(key) is int:
        return Utility, key
    return None


_WIRE_PATH = re.compile(r"`\$\[(\d+)\](?:\[(\d+)\])?`")


def describe_decode_error(error: Exception) -> str:
    """A decode failure of a client message in words, with an AddRequest's array path
    (`$[3][14]`) named by field (sampling_params.logprobs)."""
    if not isinstance(error, msgspec.MsgspecError):
        # NOTE: SamplingParams' own validation, run by the decoder, says it in words already.
        return str(error) if isinstance(error, Exception) and str(error) else repr(error)

    def name(match: re.Match[str]) -> str:
        # NOTE: item 0 of a tagged array is the tag, so field i is item i + 1.
        fields = AddRequest.__struct_fields__
        top = int(match[1]) - 1
        if not 0 <= top < len(fields):
            return match[0]
        if match[2] is None:
            return fields[top]
        inner = int(match[2])
        params = SamplingParams.__struct_fields__
        if fields[top] == "sampling_params" and inner < len(params):
            return f"sampling_params.{params[inner]}"
        return f"{fields[top]}[{inner}]"

    return _WIRE_PATH.sub(name, str(error))


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprob of one sampled token plus the top alternatives at that position; `rank` is the
    sampled token's (1 + the number of tokens more likely; 0: not computed)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0


class SampleFinish(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sample `index` of a request ended; it gets no token after this."""

    request_id: str
    finish_reason: FinishReason
    index: int = 0
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class PooledOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A pooling request's result (or a generation request's prompt logprobs), sent just before
    its finish: `data` is little-endian float32, an embedding or the classifier's logits per
    prompt, one after the other, or (PROMPT_LOGPROBS) each prompt position's logprob after the
    first, with `ranks` (int32) and `top_token_ids` (int32) / `top_logprobs` (float32), k per
    position.
    """

    request_id: str
    data: bytes
    ranks: bytes = b""
    top_token_ids: bytes = b""
    top_logprobs: bytes = b""


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # NOTE: cumulative seconds; busy = inside EngineCore.step, forward = model forward + sampling.
    busy_time_s: float = 0.0
    forward_time_s: float = 0.0


class Ready(_Msg, tag=10):
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str
    vocab_size: int
    kv_cache_bytes: int
    attention_backend: str
    pid: int
    # NOTE: the kernels chosen at start-up (by measurement or forced), one line each, and the
    # warnings about them that the user should see once.
    kernels: list[str] = msgspec.field(default_factory=list)
    kernel_warnings: list[str] = msgspec.field(default_factory=list)


class StartupFailed(_Msg, tag=11):
    """The core could not start; `kind` names its error when that is a settled one (a model it
    cannot load, settings or LoRA adapters it refuses: "ModelLoadError", "ConfigError",
    "LoraError"), which starting again with the same settings would repeat; "" otherwise."""

    message: str
    traceback: str = ""
    kind: str = ""


class StartupProgress(_Msg, tag=12):
    stage: str


class EngineOutputs(_Msg, tag=13):
    """One or more core steps' results, columnar: entry j says sample `indices[j]` of request
    `request_ids[j]` sampled `token_ids[j]`, with `logprobs[j]` when any entry asked for them.

    Entries keep step order; `finished` samples ended after their last entry here.
    `num_cached_tokens` maps a request to its prompt-cache hit when a sample of it got its first
    token here (a finish carries its own).
    """

    request_ids: list[str] = msgspec.field(default_factory=list)
    indices: list[int] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    finished: list[SampleFinish] = msgspec.field(default_factory=list)
    num_cached_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    pooled: list[PooledOutput] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.request_ids or self.finished or self.pooled)


class UtilityResult(_Msg, tag=14):
    call_id: int
    result: SchedulerStats | None = None
    error: str | None = None


class EngineError(_Msg, tag=15):
    """The core's loop failed after READY; the core exits right after sending this."""

    message: str
    traceback: str = ""


class Heartbeat(_Msg, tag=16):
    """Sent after READY about every second by a core thread that does not wait on the busy loop.

    `loop_age_s` is how long the busy loop has been in its current iteration (one step, or an
    idle wait of at most STATS_INTERVAL_S): a live core whose loop is stuck shows a growing age.
    `loop_cpu_s` is the CPU time the core process used in that iteration: a step that computes
    uses it, a deadlocked one does not. `step_limit_s` is how long a computing step may run,
    sized by the core from the step times it measured (see core_process.step_limit).
    """

    loop_age_s: float = 0.0
    loop_cpu_s: float = 0.0
    step_limit_s: float = 0.0


CoreMessage = (
    Ready
    | StartupFailed
    | StartupProgress
    | EngineOutputs
    | UtilityResult
    | EngineError
    | Heartbeat
)

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(CoreMessage)
core_decoder = msgspec.msgpack.Decoder(ClientMessage)
