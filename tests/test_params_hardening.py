"""Bad sampling params never reach the engine core, and a stopped sample stops decoding (issue 12).

On the tiny random model: params made invalid after construction are refused where they are
submitted (LLM, its core client, a job's rows), and with n > 1 a sample that completes a stop
string is aborted in the core alone, while its siblings go on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from vbatch import LLM, SamplingParams
from vbatch.client.detokenizer import IncrementalDetokenizer
from vbatch.client.outputs import RequestState
from vbatch.errors import SamplingParamsError
from vbatch.job.runner import JobSpec, RunOptions, start_job
from vbatch.llm import Request
from vbatch.protocol import AddRequest, EngineOutputs, FinishReason, SampleFinish, pack_token_ids
from vbatch.sampling_params import MAX_N

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(
        str(tiny_model_dir),
        device="cpu",
        num_threads=1,
        max_num_seqs=8,
        num_kv_blocks=256,
        attention_backend="torch",
    ) as llm:
        yield llm


def assert_idle_and_working(llm: LLM) -> None:
    stats = llm.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    (out,) = llm.generate(["still fine"], GREEDY)
    assert out.error is None and len(out.outputs[0].token_ids) == 4


def test_params_are_refused_at_submit_when_a_token_id_is_past_the_vocabulary(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=4, logit_bias={10**6: 1.0})
    with pytest.raises(SamplingParamsError, match="below the vocabulary size"):
        llm.generate(["a", "b"], bad)
    with pytest.raises(SamplingParamsError, match="below the vocabulary size"):
        next(llm.stream(["a"], bad))
    # NOTE: the core client refuses the whole batch before anything is queued for the core.
    good = AddRequest("direct-good", pack_token_ids([1, 2]), GREEDY)
    with pytest.raises(SamplingParamsError, match="below the vocabulary size"):
        llm._client.add_requests([good, AddRequest("direct-bad", pack_token_ids([1]), bad)])
    assert_idle_and_working(llm)


def test_a_requests_own_bad_params_give_an_error_output(llm: LLM) -> None:
    mutated = SamplingParams(max_tokens=4)
    with pytest.raises(SamplingParamsError, match="ignore_eos must be true or false"):
        mutated.ignore_eos = "yes"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        wrong = Request(id="wrong-type", prompt="z", sampling_params={"n": 2})  # type: ignore[arg-type]
        next(llm.stream([wrong], GREEDY))
    # NOTE: the vocabulary bound is known only once the engine runs; min_tokens made the core's
    # sampler index its logits with this id.
    beyond_vocab = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[VOCAB_SIZE])
    inputs = [
        Request(id="ok", prompt="fine"),
        Request(id="vocab", prompt="y", sampling_params=beyond_vocab),
        Request(id="ok2", prompt="fine too"),
    ]
    outs = {o.request_id: o for o in llm.stream(inputs, GREEDY)}
    assert outs["ok"].error is None and outs["ok2"].error is None
    assert f"below the vocabulary size {VOCAB_SIZE}" in outs["vocab"].error
    for rid in ("vocab",):
        assert [o.finish_reason for o in outs[rid].outputs] == ["error"]
    assert_idle_and_working(llm)


# NOTE: the rows issue 12 found hanging or killing a job, and one only the engine can judge.
BAD_ROWS = {
    "logprobs-true": ({"logprobs": True}, "logprobs must be null or an integer"),
    "stop-id-true": ({"stop_token_ids": [True]}, "stop_token_ids must be a list of integers"),
    "ignore-eos-str": ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    "include-stop-1": (
        {"include_stop_str_in_output": 1},
        "include_stop_str_in_output must be true or false",
    ),
    "skip-special-str": ({"skip_special_tokens": "no"}, "skip_special_tokens must be true"),
    # NOTE: 2**64 fits no 64-bit integer (the reader refuses the line, keeping its id);
    # 2**64 - 1 is an integer past int64.
    "seed-2**64": ({"seed": 2**64}, "the integer 18446744073709551616 does not fit 64 bits"),
    "seed-u64": ({"seed": 2**64 - 1}, "seed must fit in a 64-bit signed integer"),
    "stop-id-2**64": (
        {"stop_token_ids": [2**64]},
        "the integer 18446744073709551616 does not fit 64 bits",
    ),
    "stop-id-u64": ({"stop_token_ids": [2**64 - 1]}, "stop_token_ids must be a list of integers"),
    "top-p-tiny": ({"top_p": 1e-46, "temperature": 1}, "is 0 in float32"),
    "stop-id-float": ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of integers"),
    "n-huge": ({"n": 10**6}, "n must be at most 256"),
    "stop-id-vocab": (
        {"stop_token_ids": [VOCAB_SIZE], "min_tokens": 1},
        f"below the vocabulary size {VOCAB_SIZE}",
    ),
}


def test_a_job_turns_each_bad_row_into_an_error_row(
    tmp_path: Path, tiny_model_dir: Path, llm: LLM
) -> None:
    records: list[dict[str, Any]] = [{"id": "good0", "prompt": "hello"}]
    for rid, (overrides, _) in BAD_ROWS.items():
        records.append({"id": rid, "prompt": "bad row", "sampling_params": overrides})
    records.append({"id": "good1", "prompt": "world", "sampling_params": {"n": 2, "seed": -3}})
    input_path = tmp_path / "in.jsonl"
    # NOTE: json, not orjson, writes integers past 64 bits, as a user's file may hold them.
    input_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = JobSpec(
        input_path,
        tmp_path / "out.jsonl",
        model=str(tiny_model_dir),
        sampling={"max_tokens": 3, "temperature": 0.0},
    )
    shared = _Shared(llm)
    outcome = start_job(
        job, RunOptions(display="quiet", commit_every_rows=4), llm_factory=lambda *a, **k: shared
    )
    assert outcome.exit_code == 0, outcome.message
    rows = {
        r["id"]: r for r in map(orjson.loads, (tmp_path / "out.jsonl").read_bytes().splitlines())
    }
    assert set(rows) == {"good0", "good1", *BAD_ROWS}
    for rid, (_, message) in BAD_ROWS.items():
        assert rows[rid]["finish_reason"] == "error", rid
        assert message in rows[rid]["error"], (rid, rows[rid]["error"])
    assert rows["good0"]["error"] is None and rows["good0"]["completion_tokens"] == 3
    assert rows["good1"]["error"] is None and rows["good1"]["finish_reasons"] == ["length"] * 2
    assert_idle_and_working(llm)


class _Shared:
    """The module's LLM lent to a job, whose shutdown() leaves it running."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        pass


def counting_outputs(llm: LLM, received: Counter[tuple[str, int]]) -> Callable[..., Any]:
    """A get_outputs that also counts the tokens the core sent per (request id, sample)."""
    get_outputs = llm._client.get_outputs

    def wrapper(timeout: float | None = None) -> list[EngineOutputs]:
        steps = get_outputs(timeout)
        for step in steps:
            received.update(zip(step.request_ids, step.indices))
        return steps

    return wrapper


def test_a_sample_that_hits_a_stop_string_stops_decoding_in_the_core(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    max_tokens = 480
    params = SamplingParams(n=4, max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    (free,) = llm.generate(["tell me a story"], params)
    texts = [o.text for o in free.outputs]
    # NOTE: a 10-character stop string from sample 0's first tokens that no other sample
    # produced, so only sample 0 stops. Once it stops the others decode in a batch of 3 rows,
    # which MKL may round otherwise than 4 (on AVX2 it does), so their later tokens can differ
    # from the free run's; up to sample 0's stop the batch is the same and so are their tokens.
    early = llm.tokenizer.decode(free.outputs[0].token_ids[:8])
    stop = next(
        early[k : k + 10]
        for k in range(len(early) - 9)
        if early[k : k + 10].strip() and all(early[k : k + 10] not in t for t in texts[1:])
    )
    received: Counter[tuple[str, int]] = Counter()
    monkeypatch.setattr(llm._client, "get_outputs", counting_outputs(llm, received))
    generated_before = llm.get_stats().num_generation_tokens
    (out,) = llm.generate(["tell me a story"], params.updated({"stop": [stop]}))
    generated = llm.get_stats().num_generation_tokens - generated_before

    reasons = [o.finish_reason for o in out.outputs]
    assert reasons == ["stop", "length", "length", "length"]
    assert out.outputs[0].text == texts[0][: texts[0].index(stop)]
    kept_first = len(out.outputs[0].token_ids)
    for sample, free_sample in zip(out.outputs[1:], free.outputs[1:]):
        assert sample.token_ids[:kept_first] == free_sample.token_ids[:kept_first]
        assert stop not in sample.text
    (rid,) = {r for r, _ in received}
    # NOTE: before, a stopped sample decoded all max_tokens tokens, until its siblings were done.
    assert received[(rid, 0)] < max_tokens // 2, received
    for i, sample in enumerate(out.outputs):
        kept = len(sample.token_ids)
        if sample.finish_reason == "stop":
            # NOTE: the core stops it once the client's abort arrives, a few steps later.
            assert received[(rid, i)] - kept < max_tokens // 2, (i, kept, received)
        else:
            assert received[(rid, i)] == kept == max_tokens
    kept = sum(len(o.token_ids) for o in out.outputs)
    assert kept <= generated < kept + reasons.count("stop") * max_tokens // 2
    assert_idle_and_working(llm)


class _RecordingClient:
    def __init__(self) -> None:
        self.aborts: list[tuple[list[str], list[int] | None]] = []

    def abort(self, request_ids: list[str], indices: list[int] | None = None) -> None:
        self.aborts.append((list(request_ids), None if indices is None else list(indices)))


def collecting_llm(tokenizer: Any) -> tuple[LLM, _RecordingClient]:
    """An LLM without an engine: just what _collect() reads."""
    llm = LLM.__new__(LLM)
    llm.tokenizer = tokenizer
    client = _RecordingClient()
    llm._client = client  # type: ignore[assignment]
    return llm, client


def request_state(llm: LLM, params: SamplingParams) -> RequestState:
    n = params.n
    return RequestState(
        request=Request(prompt="p"),
        position=0,
        prompt_token_ids=[1],
        detoks=[IncrementalDetokenizer(llm.tokenizer, params) for _ in range(n)],
        reasons=[None] * n,
        logprobs=[None] * n,
        num_core_live=n,
    )


def test_the_client_aborts_only_the_sample_that_hit_its_stop_string(tokenizer: Any) -> None:
    llm, client = collecting_llm(tokenizer)
    (stop_id,) = tokenizer.encode_batch(["hello"], add_special_tokens=False)[0][:1]
    stop = tokenizer.decode([stop_id])
    (other_id,) = tokenizer.encode_batch([" world"], add_special_tokens=False)[0][:1]
    params = SamplingParams(n=3, max_tokens=8, stop=[stop])
    live = {"r": request_state(llm, params)}
    ready: list[Any] = []
    step = EngineOutputs(
        request_ids=["r", "r", "r"], indices=[0, 1, 2], token_ids=[other_id, stop_id, other_id]
    )
    llm._collect([step], live, ready)
    assert client.aborts == [(["r"], [1])]
    assert not ready and live["r"].num_open == 2
    # NOTE: the core's ABORT finish of sample 1 changes nothing; once the others stop, the
    # request is done and the rest of it is aborted whole.
    finishes = [SampleFinish("r", FinishReason.ABORT, index=1)]
    step = EngineOutputs(
        request_ids=["r", "r"], indices=[0, 2], token_ids=[stop_id, stop_id], finished=finishes
    )
    llm._collect([step], live, ready)
    assert client.aborts[1:] == [(["r"], None)]
    (output,) = (out for _, out in ready)
    assert [o.finish_reason for o in output.outputs] == ["stop"] * 3
    assert not live


def test_request_state_counts_its_open_samples(tokenizer: Any) -> None:
    llm, _ = collecting_llm(tokenizer)
    state = request_state(llm, SamplingParams(n=MAX_N))
    # NOTE: is_done is asked once per finish; a scan of all n reasons made a request cost n**2.
    state.reasons = _NoScan(state.reasons)
    for i in range(MAX_N):
        assert not state.is_done
        state.finish(SampleFinish("r", FinishReason.LENGTH, index=i))
    assert state.is_done and state.num_open == 0
    errored = request_state(llm, SamplingParams(n=4))
    errored.finish(SampleFinish("r", FinishReason.ERROR, error="boom"))
    assert errored.is_done and errored.error == "boom"


class _NoScan(list):
    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("RequestState scanned all of its samples' reasons")


def test_params_are_validated_once_where_they_are_made(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: they were validated three more times per row in this process (generate, submit,
    # the core client) and once in the core's decode.
    params = SamplingParams(max_tokens=2, temperature=0.0)
    calls = Counter[str]()
    original = SamplingParams.validate

    def counting(self: SamplingParams, vocab_size: int | None = None) -> SamplingParams:
        calls["validate"] += 1
        return original(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "validate", counting)
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert calls["validate"] == 0


def test_the_core_trusts_decoded_params(tmp_path: Path) -> None:
    script = (
        "import msgspec\n"
        "from vbatch.protocol import AddRequest, core_decoder, encoder, pack_token_ids\n"
        "from vbatch.sampling_params import SamplingParams, trust_decoded\n"
        "p = SamplingParams(max_tokens=2)\n"
        "msgspec.structs.force_setattr(p, 'top_p', 5.0)\n"
        "data = encoder.encode(AddRequest('r', pack_token_ids([1]), p))\n"
        "try:\n"
        "    core_decoder.decode(data)\n"
        "except Exception:\n"
        "    print('validated')\n"
        "trust_decoded()\n"
        "print(core_decoder.decode(data).sampling_params.top_p)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["validated", "5.0"]
