"""Round trips of every message in vbatch.protocol through the real encoder and decoders."""

from __future__ import annotations

import msgspec
import pytest

from vbatch.protocol import (
    Abort,
    AddRequest,
    EngineError,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Ready,
    SampleFinish,
    SchedulerStats,
    Shutdown,
    StartupFailed,
    StartupProgress,
    TokenLogprobs,
    Utility,
    UtilityResult,
    client_decoder,
    core_decoder,
    describe_decode_error,
    encoder,
    pack_token_ids,
    undecodable_target,
    unpack_token_ids,
)
from vbatch.sampling_params import SamplingParams

CLIENT_MESSAGES = [
    AddRequest("r1", pack_token_ids([1, 2, 3]), SamplingParams(max_tokens=5, stop=["x"]), 12.5),
    AddRequest("r2", pack_token_ids([]), SamplingParams()),
    Abort(["r1", "r2"]),
    Utility(7, "stats"),
    Shutdown(),
]

STATS = SchedulerStats(
    num_running=3, kv_usage=0.25, num_steps=9, busy_time_s=1.5, forward_time_s=1.25
)
CORE_MESSAGES = [
    Ready(
        max_model_len=512,
        num_kv_blocks=64,
        block_size=16,
        device="cpu",
        dtype="float32",
        vocab_size=49152,
        kv_cache_bytes=1 << 20,
        attention_backend="torch",
        pid=123,
    ),
    StartupFailed("model path /x does not exist", "Traceback ..."),
    StartupProgress("loading model"),
    EngineOutputs(),
    EngineOutputs(
        request_ids=["r1", "r2"],
        indices=[0, 1],
        token_ids=[5, 7],
        logprobs=[None, TokenLogprobs(-0.5, [7, 8], [-0.5, -1.5])],
        finished=[
            SampleFinish("r2", FinishReason.STOP, index=1, stop_reason=2, num_cached_tokens=16),
            SampleFinish("r3", FinishReason.ERROR, error="prompt too long"),
        ],
        num_cached_tokens={"r1": 32},
        stats=STATS,
        timestamp=1700000000.5,
    ),
    UtilityResult(7, result=STATS),
    UtilityResult(8, error="unknown utility method 'x'"),
    EngineError("RuntimeError: boom", "Traceback ..."),
    Heartbeat(loop_age_s=0.25),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(msg: msgspec.Struct) -> None:
    decoded = core_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("msg", CORE_MESSAGES, ids=lambda m: type(m).__name__)
def test_core_messages_round_trip(msg: msgspec.Struct) -> None:
    decoded = client_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_finish_reason_decodes_as_enum_and_prints_lowercase() -> None:
    msg = EngineOutputs(finished=[SampleFinish("r", FinishReason.LENGTH)])
    finish = client_decoder.decode(encoder.encode(msg)).finished[0]
    assert finish.finish_reason is FinishReason.LENGTH
    assert str(finish.finish_reason) == "length"


def test_decoders_reject_the_other_direction() -> None:
    with pytest.raises(msgspec.ValidationError):
        core_decoder.decode(encoder.encode(StartupProgress("x")))
    with pytest.raises(msgspec.ValidationError):
        client_decoder.decode(encoder.encode(Shutdown()))


def test_token_ids_pack_compactly() -> None:
    ids = list(range(0, 200_000, 997))
    packed = pack_token_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert unpack_token_ids(packed) == ids


def test_decode_step_is_compact_on_the_wire() -> None:
    # NOTE: columnar and array_like: a decode step costs ~8 bytes a sequence.
    ids = [str(i) for i in range(256)]
    step = EngineOutputs(ids, [0] * 256, [4567] * 256, timestamp=1.0)
    assert len(encoder.encode(step)) < 9 * 256
    assert not step.is_empty and EngineOutputs(stats=STATS).is_empty


def test_an_undecodable_message_still_names_whom_to_answer() -> None:
    params = SamplingParams(max_tokens=2)
    msgspec.structs.force_setattr(params, "logprobs", True)
    data = encoder.encode(AddRequest("r9", pack_token_ids([1]), params))
    with pytest.raises(msgspec.ValidationError) as info:
        core_decoder.decode(data)
    assert undecodable_target(data) == (AddRequest, "r9")
    assert describe_decode_error(info.value).endswith("at sampling_params.logprobs")
    assert undecodable_target(msgspec.msgpack.encode([3, 5, 1])) == (Utility, 5)
    for data in (encoder.encode(Abort([1])), b"\xc1", msgspec.msgpack.encode([1, 2])):
        assert undecodable_target(data) is None
