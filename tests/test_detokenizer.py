"""Tests for IncrementalDetokenizer: incremental text equals the full decode cut at stops."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from helpers import sentencepiece_backend

from vbatch.client.detokenizer import IncrementalDetokenizer
from vbatch.client.tokenizer import TextTokenizer
from vbatch.sampling_params import SamplingParams

MULTIBYTE_TEXTS = [
    "Crème brûlée, naïve café — déjà vu.",
    "你好，世界！今天天气很好。",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 ok",
    "Mixed: ñ ü ß Ω ж 한국어 العربية 🙂 end",
]


def reference_text(full: str, stops: Sequence[str], include_stop: bool) -> tuple[str, str | None]:
    """Cut `full` at the stop match that ends first (longest among equal ends)."""
    best = None
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return full, None
    end, start, stop = best
    return full[: end if include_stop else start], stop


def run_chunks(
    tokenizer: TextTokenizer, ids: list[int], params: SamplingParams, rng: random.Random
) -> tuple[IncrementalDetokenizer, str | None]:
    """Feed ids in random chunk sizes, checking that text only ever grows as a prefix."""
    detok = IncrementalDetokenizer(tokenizer, params)
    full = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    pos = 0
    hit = None
    while pos < len(ids) and hit is None:
        size = rng.randint(1, 5)
        hit = detok.update(ids[pos : pos + size])
        pos += size
        if hit is None:
            assert full.startswith(detok.text), "text showed something the full decode lacks"
    if hit is None:
        hit = detok.finalize()
    return detok, hit


def biased_random_ids(rng: random.Random, vocab_size: int) -> list[int]:
    # NOTE: ids 17..272 are SmolLM2's single-byte tokens, the ones that split characters.
    length = rng.randint(1, 200)
    return [
        rng.randrange(17, 273) if rng.random() < 0.4 else rng.randrange(vocab_size)
        for _ in range(length)
    ]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_in_random_chunks_equal_full_decode(
    tokenizer: TextTokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        ids = biased_random_ids(rng, tokenizer.vocab_size)
        detok, hit = run_chunks(tokenizer, ids, params, rng)
        assert hit is None
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.token_ids == ids


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_one_token_at_a_time(tokenizer: TextTokenizer, text: str) -> None:
    ids = tokenizer.encode_batch([text])[0]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    for token_id in ids:
        detok.update([token_id])
        assert "\ufffd" not in detok.text
        assert text.startswith(detok.text)
    assert detok.finalize() is None
    assert detok.text == text


def test_split_character_is_held_back_then_flushed(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode_batch(["ok 🎉"])[0]
    partial = ids[:-1]
    assert tokenizer.decode(partial).endswith("\ufffd"), "the emoji must span several tokens"
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(partial)
    # NOTE: the space and the emoji's first byte share a token, so both are held back.
    assert detok.text == "ok"
    detok.update([ids[-1]])
    assert detok.text == "ok 🎉"
    held = IncrementalDetokenizer(tokenizer, SamplingParams())
    held.update([*partial, tokenizer.eos_token_id])
    assert held.text == "ok"
    held.finalize()
    assert held.text == tokenizer.decode(partial) == "ok \ufffd"


def test_special_tokens_skipped_or_kept(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode_batch(["Hi<|im_end|>"])[0]
    kept = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=False))
    kept.update(ids)
    kept.finalize()
    assert kept.text == "Hi<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, SamplingParams())
    skipped.update(ids)
    skipped.finalize()
    assert skipped.text == "Hi"


@pytest.mark.parametrize("include", [False, True])
def test_a_finish_on_a_stop_token_leaves_its_text_out(
    tokenizer: TextTokenizer, include: bool
) -> None:
    """As vLLM: the token the core stopped on (a stop token id, or EOS kept as text) stays in
    token_ids, and its text is in `text` only with include_stop_str_in_output."""
    ids = tokenizer.encode_batch(["Paris is big."])[0]
    stop_id = ids[-1]
    assert tokenizer.decode([stop_id]) == "."
    by_id = IncrementalDetokenizer(
        tokenizer, SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include)
    )
    by_id.update(ids)
    assert by_id.finalize(stopped_on_token=True) is None
    assert by_id.token_ids == ids
    assert by_id.text == ("Paris is big." if include else "Paris is big")
    eos_ids = tokenizer.encode_batch(["Hi<|im_end|>"])[0]
    for skip in (False, True):
        eos = IncrementalDetokenizer(
            tokenizer,
            SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include),
        )
        eos.update(eos_ids)
        eos.finalize(stopped_on_token=True)
        assert eos.text == ("Hi<|im_end|>" if include and not skip else "Hi")
    at_length = IncrementalDetokenizer(tokenizer, SamplingParams())
    at_length.update(ids)
    at_length.finalize()
    assert at_length.text == "Paris is big."


@pytest.mark.parametrize("include", [False, True])
def test_the_token_a_sample_stopped_on_is_not_checked_for_stop_strings(
    tokenizer: TextTokenizer, include: bool
) -> None:
    """As vLLM: the core's stop token completes no stop string (its text is left out), unless
    include_stop_str_in_output, where the stop string it completes wins."""
    ids = tokenizer.encode_batch(["Paris is big."])[0]
    params = SamplingParams(
        stop=["g."], stop_token_ids=[ids[-1]], include_stop_str_in_output=include
    )
    detok = IncrementalDetokenizer(tokenizer, params)
    assert detok.update(ids[:-1]) is None
    hit = detok.update(ids[-1:], stop_terminated=True)
    assert detok.finalize(stopped_on_token=True) is None
    assert detok.token_ids == ids
    assert (hit, detok.text) == (("g.", "Paris is big.") if include else (None, "Paris is big"))
    stopped_early = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["big"]))
    assert stopped_early.update(ids, stop_terminated=True) == "big"
    assert (stopped_early.token_ids, stopped_early.text) == (ids[:-1], "Paris is ")


def check_stop(
    tokenizer: TextTokenizer, text: str, stops: list[str], include: bool, expected_text: str
) -> IncrementalDetokenizer:
    """Run `text`'s tokens one by one and check text, stop and truncation against the reference."""
    ids = tokenizer.encode_batch([text])[0]
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, params)
    hit = None
    for token_id in ids:
        hit = detok.update([token_id])
        if hit is not None:
            break
    if hit is None:
        hit = detok.finalize()
    expected, expected_stop = reference_text(tokenizer.decode(ids), stops, include)
    assert (detok.text, hit) == (expected, expected_stop)
    assert reference_text(tokenizer.decode(detok.token_ids), stops, include)[0] == expected
    assert detok.text == expected_text
    assert detok.stop_str == hit
    return detok


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_first_token(tokenizer: TextTokenizer, include: bool) -> None:
    detok = check_stop(tokenizer, "Hello world", ["Hello"], include, "Hello" if include else "")
    assert len(detok.token_ids) == 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_three_tokens(tokenizer: TextTokenizer, include: bool) -> None:
    text = "The answer is antidisestablishmentarianism, clearly."
    stop = "disestablishment"
    ids = tokenizer.encode_batch([text])[0]
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    start = text.index(stop)
    num_spanned = sum(start < len(p) < start + len(stop) for p in pieces) + 1
    assert num_spanned >= 3, "the stop string must be split over at least 3 tokens"
    expected = text[: start + len(stop)] if include else text[:start]
    check_stop(tokenizer, text, [stop], include, expected)


@pytest.mark.parametrize("include", [False, True])
def test_unicode_stop_strings(tokenizer: TextTokenizer, include: bool) -> None:
    check_stop(
        tokenizer, "Party 🎉 time 你好", ["🎉"], include, "Party 🎉" if include else "Party "
    )
    check_stop(
        tokenizer, "说你好，世界", ["世界"], include, "说你好，世界" if include else "说你好，"
    )


@pytest.mark.parametrize("include", [False, True])
def test_earliest_stop_string_wins(tokenizer: TextTokenizer, include: bool) -> None:
    text = "alpha beta gamma delta"
    check_stop(tokenizer, text, ["delta", "beta", "gamma"], include, text[: 10 if include else 6])
    check_stop(
        tokenizer, "one two three", ["two three", "two"], include, "one two" if include else "one "
    )
    # NOTE: matches ending at the same character: the longer one (earlier start) wins.
    check_stop(tokenizer, "xyz abc", ["c", "bc"], include, "xyz abc" if include else "xyz a")


def test_no_stop_string_in_text(tokenizer: TextTokenizer) -> None:
    check_stop(tokenizer, "nothing to see", ["STOP", "\n\n"], False, "nothing to see")


def test_updates_after_a_stop_are_ignored(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode_batch(["one two three four"])[0]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[" two"]))
    assert detok.update(ids) == " two"
    assert detok.text == "one"
    assert tokenizer.decode(detok.token_ids) == "one two"
    assert detok.update(ids) is None
    assert detok.finalize() is None
    assert (detok.text, detok.is_stopped) == ("one", True)


@pytest.mark.parametrize(("min_tokens", "num_tokens"), [(0, 2), (1, 2), (2, 4), (3, 4), (4, 6)])
def test_stop_strings_wait_for_min_tokens(
    tokenizer: TextTokenizer, min_tokens: int, num_tokens: int
) -> None:
    """As vLLM: a stop string must end in the text of a token after the first min_tokens (the
    earliest stop is token min_tokens + 1, as for EOS and stop ids)."""
    ids = tokenizer.encode_batch(["a b a b a b"])[0]
    assert len(ids) == 6
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[" b"], min_tokens=min_tokens))
    for token_id in ids:
        if detok.update([token_id]) is not None:
            break
    assert len(detok.token_ids) == num_tokens
    assert detok.text == tokenizer.decode(ids[: num_tokens - 1])


def test_random_stop_strings_match_reference(tokenizer: TextTokenizer) -> None:
    rng = random.Random(99)
    alphabet = ["a", "b", " ", "ab", "é", "你", "🎉", "\n"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 6)])
        include = rng.random() < 0.5
        ids = tokenizer.encode_batch([text])[0]
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok, hit = run_chunks(tokenizer, ids, params, rng)
        expected = reference_text(tokenizer.decode(ids), stops, include)
        assert (detok.text, hit) == expected, (text, stops, include)
        assert reference_text(tokenizer.decode(detok.token_ids), stops, include) == expected


@pytest.mark.parametrize("include", [False, True])
def test_a_sentencepiece_output_keeps_its_first_space_after_the_prompt(include: bool) -> None:
    """As vLLM: the output is decoded after the prompt's last tokens, so a decoder that strips
    the text's first space strips the prompt's, and " Paris" ends the output's first token.
    Before, the output read "Paris Paris" and a stop string " Paris" missed its first token."""
    sp = TextTokenizer(sentencepiece_backend(), {"bos_token": "<s>", "eos_token": "</s>"})
    prompt = sp.encode_batch(["The capital of France is"], add_special_tokens=False)[0]
    paris = sp.backend.token_to_id("▁Paris")
    plain = IncrementalDetokenizer(sp, SamplingParams(), prompt)
    plain.update([paris, paris])
    assert plain.finalize() is None
    assert plain.text == " Paris Paris"
    stops = SamplingParams(stop=[" Paris"], include_stop_str_in_output=include)
    stopped = IncrementalDetokenizer(sp, stops, prompt)
    assert stopped.update([paris]) == " Paris"
    assert stopped.text == (" Paris" if include else "")
    ended = IncrementalDetokenizer(sp, SamplingParams(), prompt)
    ended.update([paris, sp.eos_token_id])
    ended.finalize(stopped_on_token=True)
    assert ended.text == " Paris"


def test_a_prompt_of_whole_characters_leaves_a_byte_level_output_as_its_own_decode(
    tokenizer: TextTokenizer,
) -> None:
    rng = random.Random(99)
    prompts = [tokenizer.encode_batch([text])[0] for text in [*MULTIBYTE_TEXTS, "Hi"]]
    for _ in range(100):
        ids = biased_random_ids(rng, tokenizer.vocab_size)
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(), rng.choice(prompts))
        detok.update(ids)
        detok.finalize()
        assert detok.text == tokenizer.decode(ids)


def test_an_output_that_completes_the_prompts_split_character_begins_with_it(
    tokenizer: TextTokenizer,
) -> None:
    """As vLLM: the text of the prompt's last token, left unfinished by a split character (here
    the space sharing a token with the emoji's first byte), comes with the output's that
    finishes it."""
    ids = tokenizer.encode_batch(["ok 🎉 done"], add_special_tokens=False)[0]
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    finished = next(i for i in range(split, len(ids)) if "🎉" in tokenizer.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), ids[:split])
    detok.update(ids[split : finished + 1])
    assert tokenizer.decode(ids[:split]) == "ok \ufffd"
    assert detok.text == " 🎉"
    detok.update(ids[finished + 1 :])
    detok.finalize()
    assert detok.text == " 🎉 done"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_after_any_prompt_the_text_only_grows_and_finalizes_to_the_full_decode(
    tokenizer: TextTokenizer, skip_special_tokens: bool
) -> None:
    """Prompts and outputs of random ids, split characters at either end of the prompt."""
    rng = random.Random(7)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(200):
        prompt = biased_random_ids(rng, tokenizer.vocab_size)
        ids = biased_random_ids(rng, tokenizer.vocab_size)
        detok = IncrementalDetokenizer(tokenizer, params, prompt)
        seen: list[str] = []
        for start in range(0, len(ids), 3):
            detok.update(ids[start : start + 3])
            seen.append(detok.text)
        detok.finalize()
        assert all(detok.text.startswith(text) for text in seen)
        full = tokenizer.decode(prompt[-24:] + ids, skip_special_tokens=skip_special_tokens)
        assert full.endswith(detok.text)
