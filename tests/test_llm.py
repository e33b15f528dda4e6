"""vbatch.LLM end to end on a tiny random model: generate, stream, stops, aborts, errors, guard."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import sentencepiece_backend, wait_gone

from vbatch import LLM, SamplingParams
from vbatch.errors import ConfigError, EngineDeadError, ModelLoadError, VbatchError
from vbatch.llm import TOKENIZE_BATCH, Request, RequestOutput
from vbatch.lora import LoRARequest

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(
        str(tiny_model_dir),
        device="cpu",
        num_threads=1,
        max_num_seqs=8,
        num_kv_blocks=128,
        attention_backend="torch",
    ) as llm:
        yield llm


def assert_idle(llm: LLM) -> None:
    # NOTE: the stats call travels behind any abort on the same socket, so it sees its effect.
    stats = llm.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_engine_info_and_defaults(llm: LLM) -> None:
    assert llm.engine_info.max_model_len == 512
    assert llm.max_in_flight == 16
    assert llm.tokenizer.encode_batch(["hi"])[0]


def test_generate_keeps_input_order_and_matches_stream(llm: LLM) -> None:
    prompts = ["one", "two two", "three three three", "four", "five"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.index for o in outs] == list(range(5))
    assert [o.prompt for o in outs] == prompts
    for out in outs:
        (sample,) = out.outputs
        assert sample.finish_reason == "length"
        assert len(sample.token_ids) == 12
        assert sample.text == llm.tokenizer.decode(sample.token_ids)
        assert out.error is None
        assert out.arrival_time <= out.first_token_time <= out.finish_time
    streamed = {o.index: o for o in llm.stream(prompts, GREEDY)}
    assert sorted(streamed) == list(range(5))
    assert all(streamed[i].prompt == prompts[i] for i in range(5))
    assert_idle(llm)


def test_stream_yields_in_completion_order(llm: LLM) -> None:
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    inputs = [Request(id="long", prompt="a long one", sampling_params=long)]
    inputs += [Request(id=f"s{i}", prompt=f"short {i}") for i in range(4)]
    order = [o.request_id for o in llm.stream(inputs, short)]
    assert sorted(order) == ["long", "s0", "s1", "s2", "s3"]
    assert order[-1] == "long"


def test_stop_string_finishes_the_output_and_aborts_in_the_core(llm: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (free,) = llm.generate(["stop here please"], params)
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(["stop here please"], long)
    sample = out.outputs[0]
    assert sample.finish_reason == "stop"
    assert sample.stop_reason == stop
    assert sample.text == text[: text.index(stop)]
    assert len(sample.token_ids) <= 40
    assert_idle(llm)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_ends_the_tokens_and_its_text_is_left_out(llm: LLM, include: bool) -> None:
    """As vLLM: the stop token is the last of token_ids; its text is in `text` only with
    include_stop_str_in_output."""
    (free,) = llm.generate(["stop on a token"], GREEDY)
    tokens = free.outputs[0].token_ids
    stop_id = next(t for t in tokens[3:] if llm.tokenizer.decode([t]))
    cut = tokens.index(stop_id) + 1
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[stop_id],
        include_stop_str_in_output=include,
    )
    (sample,) = llm.generate(["stop on a token"], params)[0].outputs
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop_id)
    assert sample.token_ids == tokens[:cut]
    assert sample.text == llm.tokenizer.decode(tokens[: cut if include else cut - 1])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_whose_text_completes_a_stop_string(llm: LLM, include: bool) -> None:
    """As vLLM: the token the core stopped on is not checked against stop strings, so the
    finish keeps the token id as its stop_reason; with include_stop_str_in_output its text is
    checked, and the stop string wins."""
    (free,) = llm.generate(["stop on a token"], GREEDY)
    tokens = free.outputs[0].token_ids
    decode = llm.tokenizer.decode
    cut = next(
        k + 1
        for k in range(len(tokens))
        if decode([tokens[k]]).strip() and decode([tokens[k]]) not in decode(tokens[:k])
    )
    stop_id, stop = tokens[cut - 1], decode([tokens[cut - 1]])
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[stop_id],
        stop=[stop],
        include_stop_str_in_output=include,
    )
    (sample,) = llm.generate(["stop on a token"], params)[0].outputs
    assert sample.token_ids == tokens[:cut]
    assert sample.finish_reason == "stop"
    assert sample.stop_reason == (stop if include else stop_id)
    assert sample.text == decode(tokens[: cut if include else cut - 1])


def test_a_request_whose_every_token_is_excluded_is_an_error_alone(llm: LLM) -> None:
    """Its allowed token is a bad word: greedy and top-p alike end it with an error (top-p's
    placeholder id once reached the embedding and failed the whole step); its batch goes on."""
    cat = llm.get_tokenizer().encode(" cat", add_special_tokens=False)
    assert len(cat) == 1
    stuck = [
        SamplingParams(max_tokens=4, allowed_token_ids=cat, bad_words=["cat"], **mode)
        for mode in ({"temperature": 0.0}, {"top_p": 0.5, "seed": 0})
    ]
    outs = llm.generate(["Hi", "Hello there", "One two"], [*stuck, GREEDY])
    for out in outs[:2]:
        assert out.error is not None and "no token is left to sample" in out.error
    (alone,) = llm.generate(["One two"], GREEDY)
    assert outs[2].error is None
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(llm)


def test_bad_words_are_tokenized_for_each_call(llm: LLM) -> None:
    """The caller's SamplingParams is not written to: a word appended to its bad_words list in
    place is banned in the next call, as vLLM tokenizes bad words per request."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, bad_words=["zq"])
    (free,) = llm.generate(["stop on a token"], params)
    first = free.outputs[0].token_ids[0]
    params.bad_words.append(llm.tokenizer.decode([first]).strip())
    (banned,) = llm.generate(["stop on a token"], params)
    assert first not in banned.outputs[0].token_ids
    assert params.bad_words_token_ids == []


def test_the_sampled_token_is_the_first_key_of_its_logprobs(llm: LLM) -> None:
    """As vLLM: each position's logprobs dict starts with the sampled token, whatever its rank,
    then the top tokens by rank."""
    params = [
        SamplingParams(max_tokens=8, top_k=3, logprobs=3, seed=seed, ignore_eos=True)
        for seed in range(4)
    ]
    samples = [out.outputs[0] for out in llm.generate(["stop on a token"] * 4, params)]
    positions = [
        (token_id, entry)
        for sample in samples
        for token_id, entry in zip(sample.token_ids, sample.logprobs, strict=True)
    ]
    assert any(entry[token_id].rank > 1 for token_id, entry in positions)
    for token_id, entry in positions:
        assert next(iter(entry)) == token_id
        ranks = [logprob.rank for logprob in entry.values()][1:]
        assert ranks == sorted(ranks)


def test_breaking_out_of_stream_aborts_everything_in_flight(llm: LLM) -> None:
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = Request(prompt="quick", sampling_params=SamplingParams(max_tokens=1))
    stream = llm.stream(itertools.chain([short], itertools.repeat("slow")), params)
    with contextlib.closing(stream):
        first = next(stream)
    assert first.outputs[0].finish_reason == "length"
    assert_idle(llm)
    # NOTE: late ABORT deltas of the closed stream must not leak into the next one.
    (out,) = llm.generate(["after"], GREEDY)
    assert out.outputs[0].finish_reason == "length"


def test_lookahead_is_bounded_for_an_endless_input(llm: LLM) -> None:
    pulled = itertools.count()

    def endless() -> Iterator[str]:
        while True:
            next(pulled)
            yield "again"

    stream = llm.stream(endless(), SamplingParams(max_tokens=2))
    with contextlib.closing(stream):
        for _ in range(40):
            next(stream)
    assert next(pulled) <= 40 + llm.max_in_flight + TOKENIZE_BATCH
    assert_idle(llm)


def test_per_request_errors_are_outputs_not_exceptions(llm: LLM) -> None:
    inputs = [
        Request(id="ok", prompt="fine"),
        Request(id="long", prompt_token_ids=[1] * 600),
        Request(id="bad", messages=[{"role": "user"}]),
        Request(id="empty"),
        [{"role": "user", "content": "hello"}],
    ]
    outs = {o.request_id: o for o in llm.stream(inputs, GREEDY)}
    assert outs["ok"].error is None
    assert outs["4"].error is None and outs["4"].outputs[0].finish_reason == "length"
    for rid in ("long", "bad", "empty"):
        assert outs[rid].error, rid
        assert outs[rid].outputs[0].finish_reason == "error"
    assert "content" in outs["bad"].error


def test_an_error_output_has_one_empty_completion_whatever_its_n_and_cause(llm: LLM) -> None:
    """A request the core rejected (a token outside the vocabulary, a prompt too long) once
    came back with n error completions, one refused in the client with one (python-api.md:
    "its one CompletionOutput")."""
    params = SamplingParams(n=2, max_tokens=2)
    inputs = [
        Request(id="oov", prompt_token_ids=[10**6]),
        Request(id="long", prompt_token_ids=[1] * 600),
        Request(id="bad", messages=[{"role": "user"}]),
        Request(id="lora", prompt="x", lora_request=LoRARequest("a", 1, "/nowhere")),
    ]
    outs = {o.request_id: o for o in llm.stream(inputs, params)}
    for rid, out in outs.items():
        assert out.error, rid
        assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in out.outputs] == [
            (0, "", [], "error")
        ], rid


def test_a_prompt_far_past_the_model_length_is_refused_before_its_encoding(llm: LLM) -> None:
    """A 10.8 MB prompt was encoded whole (about 1 GB in the client) before the core refused it;
    truncate_prompt_tokens still encodes it and keeps its end."""
    vocab = llm.tokenizer.backend.get_vocab(with_added_tokens=True)
    longest = max(len(token.encode()) for token in vocab)
    huge = "word " * (llm.engine_info.max_model_len * longest // 5 + 1)
    one = SamplingParams(max_tokens=1)
    (out,) = llm.generate([huge], one, use_tqdm=False)
    (chat,) = llm.chat([[{"role": "user", "content": huge}]], one, use_tqdm=False)
    for refused in (out, chat):
        assert refused.error is not None and refused.error.startswith("the prompt has at least")
        assert "characters), which leaves no room for output" in refused.error
    cut = SamplingParams(max_tokens=1, truncate_prompt_tokens=8)
    (kept,) = llm.generate([huge], cut, use_tqdm=False)
    assert kept.error is None and len(kept.prompt_token_ids) == 8


def test_token_ids_outside_the_vocabulary_are_error_outputs_in_their_place(llm: LLM) -> None:
    """A negative id, or one past 2^31, failed the whole call (the detokenizer and the int32
    wire form raised before the core's check), and the other prompts got no result."""
    bad = [[5, -1], [2**31], [2**40], [llm.engine_info.vocab_size]]
    outs = llm.generate(
        ["Hello", *({"prompt_token_ids": ids} for ids in bad)], SamplingParams(max_tokens=2)
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 2
    message = f"prompt token ids must lie in [0, {llm.engine_info.vocab_size})"
    assert [out.error for out in outs[1:]] == [message] * len(bad)


def test_n_samples_and_on_output(llm: LLM) -> None:
    seen: list[RequestOutput] = []
    thread_names: set[str] = set()

    def on_output(out: RequestOutput) -> None:
        thread_names.add(threading.current_thread().name)
        seen.append(out)

    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    outs = list(llm.stream(["sample me", "and me"], params, on_output=on_output))
    assert len(outs) == 2
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert [o.request_id for o in seen] == [o.request_id for o in outs]
    assert threading.current_thread().name not in thread_names


def test_a_feed_that_fails_hands_back_the_rows_finished_first(llm: LLM) -> None:
    """The rows finished when the feed raised were lost: neither yielded nor given to
    on_output, though the core had run them."""
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def feed() -> Iterator[Request]:
        yield Request(id="r0", prompt="a", sampling_params=one)
        yield Request(id="r1", prompt="b", sampling_params=one)
        # NOTE: asked again only once the stream's full look-ahead waited for an output.
        raise OSError("the input file went away")

    yielded: list[str] = []
    called: list[str] = []
    before = llm.max_in_flight
    llm.max_in_flight = 2
    try:
        with pytest.raises(OSError, match="went away"):
            for out in llm.stream(feed(), on_output=lambda o: called.append(o.request_id)):
                yielded.append(out.request_id)
    finally:
        llm.max_in_flight = before
    assert yielded and set(yielded) <= {"r0", "r1"}
    assert sorted(called) == sorted(yielded)
    assert_idle(llm)


def test_a_failing_callback_ends_the_stream_after_the_output_it_was_given(llm: LLM) -> None:
    """The callback's error surfaced at the next output, which it dropped (neither yielded nor
    given to the callback); closed early, the stream swallowed it without a word."""
    requests = [
        Request(id=f"c{i}", prompt="y", sampling_params=SamplingParams(max_tokens=1 + 10 * i))
        for i in range(4)
    ]
    ids = [r.id for r in requests]
    got: list[str] = []

    def fail_on_first(out: RequestOutput) -> None:
        raise ValueError(f"callback failed on {out.request_id}")

    with pytest.raises(ValueError, match="callback failed on c0"):
        for out in llm.stream(requests, on_output=fail_on_first):
            got.append(out.request_id)
            time.sleep(0.3)
    assert got and got[0] == "c0" and set(got) <= set(ids)
    assert_idle(llm)
    assert [r.num_in_flight for r in llm.engine_reports()] == [0]


def test_an_early_closed_stream_leaves_nothing_in_flight(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    """engine_reports (the dashboard's and metrics' source) counted the aborted rows as in
    flight until the next stream; a callback's error on an early close is logged."""

    def fail(out: RequestOutput) -> None:
        raise ValueError("never raised")

    stream = llm.stream(itertools.repeat("slow"), GREEDY, on_output=fail)
    with caplog.at_level(logging.WARNING, logger="vbatch"), contextlib.closing(stream):
        next(stream)
        time.sleep(0.2)
    assert [r.num_in_flight for r in llm.engine_reports()] == [0]
    assert "on_output raised ValueError('never raised')" in caplog.text
    assert_idle(llm)


@pytest.mark.parametrize(
    ("inputs", "kwargs", "message"),
    [
        (5, {}, "stream takes an iterable of prompts"),
        (b"ab", {}, "got bytes"),
        (["a"], {"on_output": 5}, "on_output must be callable"),
        (["a"], {"idle_s": -1}, "idle_s must be a number of seconds > 0"),
    ],
)
def test_stream_arguments_it_cannot_use_raise_naming_them(
    llm: LLM, inputs: Any, kwargs: dict[str, Any], message: str
) -> None:
    """Before: a bare TypeError from iter(), a busy loop of Nones, or a callback failing
    only after its request had run."""
    with pytest.raises((TypeError, ValueError), match=message):
        next(llm.stream(inputs, GREEDY, **kwargs))
    assert_idle(llm)


def test_a_second_concurrent_stream_is_refused(llm: LLM) -> None:
    first = llm.stream(["a", "b"], GREEDY)
    with contextlib.closing(first):
        next(first)
        with pytest.raises(VbatchError, match="already streaming"):
            next(llm.stream(["c"], GREEDY))
    assert_idle(llm)


def test_two_threads_cannot_both_start_a_stream(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first thread is held inside its stream's start (before, the busy flag was set only
    after the params check, so a second thread passed the guard there, the two took each
    other's outputs and one waited for ever)."""
    import vbatch.llm as llm_module

    entered, release = threading.Event(), threading.Event()
    check = llm_module.check_params_type

    def held_check(params: SamplingParams) -> None:
        if threading.current_thread().name == "first" and sys._getframe(1).f_code.co_name == (
            "_stream"
        ):
            entered.set()
            assert release.wait(30)
        check(params)

    monkeypatch.setattr(llm_module, "check_params_type", held_check)
    results: list[int] = []
    first = threading.Thread(
        target=lambda: results.append(len(llm.generate(["a"], GREEDY, use_tqdm=False))),
        name="first",
    )
    first.start()
    try:
        assert entered.wait(30)
        with pytest.raises(VbatchError, match="already streaming"):
            llm.generate(["b"], GREEDY, use_tqdm=False)
    finally:
        release.set()
        first.join(60)
    assert results == [1]
    assert len(llm.generate(["c"], GREEDY, use_tqdm=False)) == 1
    assert_idle(llm)


def test_generate_with_progress_bar(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    outs = llm.generate(["x", "y"], GREEDY, use_tqdm=True)
    assert [o.index for o in outs] == [0, 1]
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["x"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


class FailingBar:
    """A progress bar (vLLM's callable use_tqdm) whose second update raises."""

    def __init__(self, **kwargs: Any) -> None:
        self.updates = 0

    def update(self, n: int) -> None:
        self.updates += n
        if self.updates == 2:
            raise RuntimeError("the bar failed")

    def close(self) -> None:
        pass


def test_an_error_out_of_generate_leaves_nothing_streaming(llm: LLM) -> None:
    """While the exception was alive (a REPL keeps the last one), its stream stayed open: the
    next call raised "already streaming" and the failed call's requests ran on."""
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    params = [GREEDY, GREEDY, *[long] * 6]
    with pytest.raises(RuntimeError, match="the bar failed") as failed:
        llm.generate([f"p{i}" for i in range(8)], params, use_tqdm=FailingBar)
    assert failed.value is not None
    assert_idle(llm)
    (again,) = llm.generate(["x"], GREEDY, use_tqdm=False)
    assert again.outputs[0].finish_reason == "length"


def test_a_dead_core_ends_the_stream_with_engine_dead_error(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, attention_backend="torch") as llm:
        quick = Request(prompt="quick", sampling_params=SamplingParams(max_tokens=1))
        slow = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = llm.stream(itertools.chain([quick], itertools.repeat("slow")), slow)
        next(stream)
        os.kill(llm.engine_info.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            next(stream)
        assert time.monotonic() - killed_at < 5.0


def test_missing_model_fails_before_spawning(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_a_script_without_a_main_guard_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The core's spawn does not run the script's top level again (it would start a second
    LLM), and the core does not import the script at all."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            from vbatch import LLM, SamplingParams
            print("top level ran in", os.getpid(), flush=True)
            llm = LLM({str(tiny_model_dir)!r}, device="cpu", num_kv_blocks=64)
            (out,) = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
            print("tokens", len(out.outputs[0].token_ids), flush=True)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("top level ran in") == 1
    assert "tokens 3" in result.stdout


@pytest.mark.parametrize(
    ("num_prompts", "num_tokens"),
    [(6, 16), pytest.param(16, 32, marks=pytest.mark.slow)],
    ids=["short", "full-size"],
)
def test_generate_on_smollm2_is_token_exact_with_hf(
    smollm2, chat_messages, prompts, assert_greedy_matches_hf, num_prompts, num_tokens
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    # NOTE: one thread: on a busy 2-core host a second one spins for a core others hold.
    with LLM(str(smollm2.source), num_threads=1) as real:
        outs = real.generate(chat_messages[:num_prompts], params)
    assert [o.prompt_token_ids for o in outs] == prompts[:num_prompts]
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(tokens) == num_tokens for tokens in got)
    assert_greedy_matches_hf(prompts[:num_prompts], got)


def test_a_multi_token_bad_word_binds_greedy_rows_in_every_step(smollm2) -> None:
    """SmolLM2 counts on with " 5, 6"; banned as a bad word, greedy decoding must leave it out
    however the steps run (a plain-greedy step's metadata, reused by the steps after it, had
    let it through), as top-1 sampling, which never took that shortcut, does."""
    prompt = "Count: 1, 2, 3, 4,"
    greedy = SamplingParams(temperature=0.0, max_tokens=6, bad_words=[" 5, 6"])
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=0, max_tokens=6, bad_words=[" 5, 6"])
    free = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(str(smollm2.source), num_threads=1) as real:
        (unbanned,) = real.generate(prompt, free, use_tqdm=False)
        (banned,) = real.generate(prompt, greedy, use_tqdm=False)
        (sampled,) = real.generate(prompt, top1, use_tqdm=False)
    assert unbanned.outputs[0].text.startswith(" 5, 6")
    assert "5, 6" not in banned.outputs[0].text
    assert banned.outputs[0].token_ids == sampled.outputs[0].token_ids


def test_a_tokenizer_that_fails_to_load_stops_the_core_started_beside_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The core starts before the tokenizer loads (to overlap the two); when the tokenizer
    fails, the core is stopped, not left running."""
    import psutil

    def cores() -> set[int]:
        children = psutil.Process().children()
        return {p.pid for p in children if "spawn_main" in " ".join(p.cmdline())}

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "tokenizer.json").write_text("{not json")
    # NOTE: this module's shared LLM keeps its own core.
    before = cores()
    with pytest.raises(VbatchError):
        LLM(str(model_dir), device="cpu", num_threads=1, attention_backend="torch")
    assert cores() <= before


def test_a_multiprocessing_child_holding_an_llm_exits_and_stops_its_core(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A multiprocessing child skips atexit, and its exit hook joins its children without a
    timeout (the core ignores SIGTERM): it hung with an LLM still held in a global."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing, sys
            from vbatch import LLM, SamplingParams
            KEPT = []

            def work() -> None:
                llm = LLM({str(tiny_model_dir)!r}, device="cpu", num_kv_blocks=64)
                KEPT.append(llm)
                out = llm.generate(["hello"], SamplingParams(max_tokens=2, ignore_eos=True))
                print("core", llm.engine_info.pid, len(out[0].outputs[0].token_ids), flush=True)

            if __name__ == "__main__":
                child = multiprocessing.get_context(sys.argv[1]).Process(target=work)
                child.start()
                child.join(60)
                print("alive", child.is_alive(), "exit", child.exitcode, flush=True)
                if child.is_alive():
                    child.kill()
            """
        )
    )
    for method in ("spawn", "fork"):
        result = subprocess.run(
            [sys.executable, str(script), method], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert "alive False exit 0" in result.stdout, (method, result.stdout, result.stderr)
        core = int(result.stdout.split("core ")[1].split()[0])
        assert wait_gone(core, 10.0), f"{method}: core {core} outlived its child"


def test_kept_results_do_not_keep_the_llm_and_its_core(tiny_model_dir: Path) -> None:
    import gc

    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64)
    core = llm.engine_info.pid
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1)
    results = llm.generate(["hello"], params, use_tqdm=False)
    del llm
    gc.collect()
    assert wait_gone(core, 10.0), "a kept result held the LLM"
    assert results[0].outputs[0].logprobs is not None


def test_stream_takes_one_prompt_as_one_and_waits_on_a_feed_without_spinning(
    llm: LLM,
) -> None:
    (one,) = list(llm.stream("hello", SamplingParams(max_tokens=2, ignore_eos=True)))
    assert one.prompt == "hello"
    deadline = time.monotonic() + 1.0

    def feed() -> Iterator[str | None]:
        while time.monotonic() < deadline:
            yield None
        yield "hi"

    start = time.process_time()
    (out,) = list(llm.stream(feed(), SamplingParams(max_tokens=2, ignore_eos=True)))
    # NOTE: 1 s of a feed with nothing ready: once this was 1 s of CPU polling it.
    assert out.prompt == "hi" and time.process_time() - start < 0.5


def test_what_vllm_has_and_vbatch_does_not_is_named(llm: LLM) -> None:
    with pytest.raises(NotImplementedError, match="vbatch has no beam search: sample several"):
        llm.beam_search(["a"], None)
    with pytest.raises(AttributeError, match="vbatch has no llm_engine"):
        _ = llm.llm_engine


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_bad_max_in_flight_is_a_config_error_as_at_the_cli(value: object) -> None:
    """It was raised to 1 without a word, where `--max-in-flight 0` is refused."""
    with pytest.raises(ConfigError, match="max_in_flight must be an integer of at least 1"):
        LLM(None, max_in_flight=value)  # type: ignore[arg-type]


def test_a_forked_child_using_the_parent_s_llm_gets_a_clear_error(llm: LLM) -> None:
    """Before, its generate() waited forever on a copy of the queues no thread served."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            llm.generate(["hello"], params)
            message = "no error"
        except EngineDeadError as e:
            message = str(e)
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode()
    assert "was forked from it; create an LLM in this process instead" in message, message
    (out,) = llm.generate(["hello"], params)
    assert len(out.outputs[0].token_ids) == 2


def test_an_llm_in_a_pool_worker_says_why_it_cannot_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Before: `the engine client thread failed: AssertionError('daemonic processes are not
    allowed to have children')`."""
    script = tmp_path / "pool.py"
    script.write_text(
        "import multiprocessing\n"
        "from vbatch import LLM\n"
        "def start(model):\n"
        "    try:\n"
        "        LLM(model)\n"
        "    except Exception as e:\n"
        "        return f'{type(e).__name__}: {e}'\n"
        "    return 'started'\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        f"        print(pool.apply(start, ({str(tiny_model_dir)!r},)))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("EngineStartupError: an engine core cannot start in a daemonic")


def test_a_sentencepiece_models_output_keeps_its_first_space(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As vLLM, the output is decoded after the prompt's last tokens: a Llama 2 style decoder
    strips the prompt's first space, not the output's, and a stop string " Paris" matches the
    first token. Before, the text read "Paris Paris" and the stop ended the second token."""
    model = tmp_path / "sp-model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, model / name)
    sentencepiece_backend().save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    with LLM(str(model), num_threads=1, num_kv_blocks=32, attention_backend="torch") as sp_llm:
        paris = sp_llm.get_tokenizer().backend.token_to_id("▁Paris")
        forced = SamplingParams(max_tokens=2, temperature=0.0, allowed_token_ids=[paris])
        stopped = SamplingParams(
            max_tokens=2, temperature=0.0, allowed_token_ids=[paris], stop=[" Paris"]
        )
        plain, stop = sp_llm.generate(
            ["The capital of France is"] * 2, [forced, stopped], use_tqdm=False
        )
    assert plain.outputs[0].text == " Paris Paris"
    assert stop.outputs[0].text == ""
    assert stop.outputs[0].token_ids == [paris]
    assert stop.outputs[0].stop_reason == " Paris"


@pytest.mark.timeout(180)
def test_two_samples_that_each_need_the_whole_cache_both_finish(tiny_model_dir: Path) -> None:
    """Seeded samples of a 40-token prompt, each needing all 4 KV blocks, in 32-token chunks:
    the preempted one hung on its prefix-cache partial copy (see test_scheduler)."""
    prompt = {"prompt_token_ids": [(17 * i) % 40000 + 100 for i in range(40)]}
    params = [
        SamplingParams(max_tokens=23, temperature=1.0, seed=seed, ignore_eos=True)
        for seed in (1, 2)
    ]
    with LLM(
        str(tiny_model_dir),
        num_threads=1,
        num_kv_blocks=4,
        block_size=16,
        max_num_batched_tokens=32,
        heartbeat_timeout_s=20,
    ) as small:
        outs = small.generate([prompt, prompt], params, use_tqdm=False)
    assert [(o.error, len(o.outputs[0].token_ids)) for o in outs] == [(None, 23), (None, 23)]


def test_the_stats_that_arrive_with_a_short_calls_last_output_are_its_final_ones(
    llm: LLM,
) -> None:
    """The core sent stats every 0.5 s only, and a job shorter than that kept its first step's
    figures (the metrics file's prefix-cache hit rate read 0.0)."""
    before = llm.get_stats()
    outs = llm.generate(["one two three four", "one two three four five"], GREEDY, use_tqdm=False)
    latest = llm.latest_stats
    assert latest is not None
    new_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert latest.num_generation_tokens == before.num_generation_tokens + new_tokens
    assert (latest.num_running, latest.num_waiting) == (0, 0)


def test_a_started_core_is_stopped_when_the_llms_own_checks_fail(tiny_model_dir: Path) -> None:
    """The core start_core() began and handed over was left running when LLM() raised on its
    own arguments (a bad max_num_seqs, an unknown keyword)."""
    from vbatch.llm import start_core

    for bad in ({"max_num_seqs": 0}, {"no_such_setting": 1}, {"on_progress": 5}):
        core = start_core(str(tiny_model_dir), num_threads=1, attention_backend="torch")
        with pytest.raises(ConfigError):
            LLM(str(tiny_model_dir), num_threads=1, started_core=core, **bad)
        assert wait_gone(core.pid, 30), bad


def test_start_core_takes_the_llms_vllm_names_and_is_adopted(tiny_model_dir: Path) -> None:
    """start_core() passed its arguments to EngineConfig as they were: vLLM's names and
    EngineArgs' None defaults (seed=None, dtype="half") were refused there."""
    from vbatch.llm import start_core

    args = {"num_threads": 1, "seed": None, "max_num_seqs": None, "dtype": "float"}
    core = start_core(str(tiny_model_dir), trust_remote_code=False, **args)
    with LLM(str(tiny_model_dir), started_core=core, trust_remote_code=False, **args) as adopted:
        assert adopted._client is core
        assert len(adopted.generate(["x"], GREEDY, use_tqdm=False)) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": 5}, "model must be a path, a hub id"),
        ({"tokenizer": 123}, "tokenizer must be a path, a hub id"),
        ({"on_progress": 5}, "on_progress must be callable"),
        ({"started_core": 5}, "started_core must be what start_core"),
    ],
)
def test_llm_arguments_of_the_wrong_type_are_config_errors(
    tiny_model_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    """Before: TypeError from pathlib, or an AttributeError, naming no argument."""
    with pytest.raises(ConfigError, match=message):
        LLM(**{"model": str(tiny_model_dir), "num_threads": 1, **kwargs})
