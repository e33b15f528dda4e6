"""Compiling constraints (engine/grammar.py) at their edges, with the tiny model's tokenizer:
labels from every Unicode plane, length-bounded strings, strict mode, the compile pool, its
budget and its thread priority, and compile time against xgrammar's own."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from vbatch.engine.grammar import (
    GrammarCache,
    GrammarError,
    _lowest_priority,
    _thread_cpu_clock,
)
from vbatch.structured import StructuredOutput

xgrammar = pytest.importorskip("xgrammar", reason="structured output needs xgrammar")

EOS = 2
# NOTE: one label per Unicode plane (0-16), the emoji of the issue among them.
PLANE_LABELS = [
    'a\u00e9\u4e2d "q" \\',
    "\U0001f600 happy",
    "\U00020000",
    "\U00030000",
    *(chr(plane << 16 | 0x41) for plane in range(4, 14)),
    "\U000e0041",
    "\U000f0000",
    "\U0010fffd",
]


@pytest.fixture(scope="module")
def cache(tiny_model_dir: Path) -> GrammarCache:
    return GrammarCache(tiny_model_dir, 49152, [EOS])


def compiled(cache: GrammarCache, **spec: Any) -> Any:
    return cache.get(StructuredOutput(**spec)).result(timeout=120)


def accepts(grammar: Any, text: str | bytes, *, complete: bool = False) -> bool:
    matcher = xgrammar.GrammarMatcher(grammar)
    return matcher.accept_string(text) and (not complete or matcher.accept_token(EOS))


def test_choice_labels_from_every_plane_are_matched_as_written(cache: GrammarCache) -> None:
    grammar = compiled(cache, choice=PLANE_LABELS)
    for label in PLANE_LABELS:
        assert accepts(grammar, label, complete=True), ascii(label)
    assert not accepts(grammar, "\ufffd")


def test_length_bounds_leave_values_alone_and_cover_nullable_strings(cache: GrammarCache) -> None:
    schema = {
        "type": "object",
        "properties": {
            "c": {"const": {"type": "string", "maxLength": 3}},
            "e": {"enum": [{"type": "string", "minLength": 1}]},
            "s": {"type": ["string", "null"], "maxLength": 3},
        },
        "required": ["c", "e", "s"],
    }
    grammar = compiled(cache, json_schema=schema)
    # NOTE: xgrammar writes const and enum values without spaces.
    head = '{"c": {"type":"string","maxLength":3}, "e": {"type":"string","minLength":1}'
    assert accepts(grammar, head + ', "s": "abc"}', complete=True)
    assert accepts(grammar, head + ', "s": null}', complete=True)
    assert not accepts(grammar, head + ', "s": "abcd"')
    assert not accepts(grammar, head + ', "s": "a\x01')


# NOTE: U+D800 and U+DFFF as xgrammar 0.2.9 encodes them; not UTF-8, they decode to U+FFFD x3.
SURROGATE_BYTES = [b"\xed\xa0\x80", b"\xed\xbf\xbf"]
UTF8_NEIGHBOURS = ["\u00e9", "\ud7ff", "\ue000", "\U0001f600"]


@pytest.mark.parametrize(
    ("spec", "head", "tail"),
    [
        ({"json_schema": {"type": "string", "maxLength": 3}}, '"', '"'),
        ({"json_schema": {"type": "string"}}, '"', '"'),
        ({"json_object": True}, '{"k": "', '"}'),
        ({"regex": ".{1,3}"}, "", ""),
        ({"regex": '[^"]+'}, "", ""),
        ({"grammar": 'root ::= [^\\x00-\\x1f"]+ | "!" [\\u0000-\\U0010ffff]'}, "", ""),
        # NOTE: xgrammar keeps these patterns as regexes in the printed grammar (`Regex("...")`).
        ({"json_schema": {"type": "string", "pattern": "^.{3}$"}}, '"', 'ab"'),
        ({"json_schema": {"type": "string", "pattern": "^\\S+$"}}, '"', '"'),
        ({"json_schema": {"type": "string", "pattern": "^[^x]+$"}}, '"', '"'),
        ({"json_schema": {"type": "string", "pattern": "^[a\\W]+$"}}, '"', '"'),
        ({"json_schema": {"type": "string", "pattern": "^[\\u0001-\\U0010ffff]+$"}}, '"', '"'),
    ],
    ids=[
        "bounded",
        "string",
        "object",
        "dot",
        "negated",
        "ebnf",
        "pattern-dot",
        "pattern-non-space",
        "pattern-negated",
        "pattern-shorthand-in-class",
        "pattern-range",
    ],
)
def test_no_constraint_admits_a_surrogate_where_utf8_characters_pass(
    cache: GrammarCache, spec: dict[str, Any], head: str, tail: str
) -> None:
    grammar = compiled(cache, **spec)
    for char in UTF8_NEIGHBOURS:
        assert accepts(grammar, head + char + tail, complete=True), (spec, ascii(char))
    for raw in SURROGATE_BYTES:
        assert not accepts(grammar, head.encode() + raw), (spec, raw)
    if "grammar" in spec:
        assert accepts(grammar, "!\u00e9", complete=True)
        assert not accepts(grammar, b"!" + SURROGATE_BYTES[0])


# NOTE: (class, a string of 3 characters it accepts, one it rejects).
CARET_CLASSES = [
    ("[\\^a]", "^a^", "bbb"),
    ("[\\^]", "^^^", "bbb"),
    ("[\\^-a]", "^_`", "---"),
    ("[^\\^a]", "bcd", "b^b"),
    ("[^a]", "^b^", "bab"),
    ("[a^]", "a^a", "bbb"),
    ("[\\\\^]", "\\^\\", "bbb"),
]


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_an_escaped_caret_first_in_a_class_is_not_a_negation(
    cache: GrammarCache, kind: str
) -> None:
    """xgrammar reads `[\\^a]` right but prints it as `[^a]`, which the printed grammar's compile
    read as a negated class."""
    for cls, accepted, rejected in CARET_CLASSES:
        spec = f"{cls}{{3}}" if kind == "regex" else f"root ::= {cls}{{3}}"
        grammar = compiled(cache, **{kind: spec})
        assert accepts(grammar, accepted, complete=True), (spec, accepted)
        assert not accepts(grammar, rejected), (spec, rejected)


def test_a_caret_in_an_ebnf_literal_comment_or_regex_is_left_alone(cache: GrammarCache) -> None:
    grammar = compiled(cache, grammar='root ::= "[\\\\^" Regex("[\\\\^a]") # [\\^b]\n')
    assert accepts(grammar, "[\\^^", complete=True)
    assert accepts(grammar, "[\\^a", complete=True)
    assert not accepts(grammar, "[\\^b")


def test_hex_escapes_keep_their_meaning_through_the_printed_grammar(cache: GrammarCache) -> None:
    """xgrammar prints U+001F as `\\x1f` and reads `\\x1fa` back as U+01FA."""
    grammar = compiled(cache, grammar='root ::= "\\u001fa" [\\u001fa-b]+')
    assert accepts(grammar, "\x1fa\x1fab", complete=True)
    assert not accepts(grammar, "\u01fa")


def test_strict_false_follows_json_schema_and_strict_explains_a_refusal(
    cache: GrammarCache,
) -> None:
    schema = {"type": "object", "minProperties": 2, "maxProperties": 2}
    grammar = compiled(cache, json_schema=schema, strict=False)
    assert accepts(grammar, '{"a": 1, "b": 2}', complete=True)
    assert not accepts(grammar, '{"a": 1}', complete=True)
    with pytest.raises(GrammarError, match='"strict": false'):
        compiled(cache, json_schema=schema)


def test_a_small_constraint_is_not_queued_behind_a_slow_one_which_fails_at_the_budget(
    tiny_model_dir: Path,
) -> None:
    """The slow compiles take ~1.8 s of CPU each, the budget 0.2 s: they fail while their
    workers compute on, and fresh workers take the next compile at once."""
    cache = GrammarCache(tiny_model_dir, 49152, [EOS], budget_s=0.2)
    slow = [cache.get(StructuredOutput(regex=f'[^\\x00-\\x1f"]{{0,{n}}}')) for n in (2000, 2001)]
    small = cache.get(StructuredOutput(choice=["yes", "no"]))
    start = time.monotonic()
    while not all(f.done() for f in slow) and time.monotonic() - start < 300:
        cache.check_budget()
        time.sleep(0.05)
    assert small.result(timeout=60) is not None
    for future in slow:
        with pytest.raises(GrammarError, match=r"within the 0\.2 s compile budget"):
            future.result(timeout=0)
    assert cache.get(StructuredOutput(regex="[ab]")).result(timeout=60) is not None
    assert cache._num_late == 2, "the next compile waited for a worker past its budget"
    cache.shutdown()
    wait_for_late_compiles(cache)


def wait_for_late_compiles(cache: GrammarCache) -> None:
    """Wait until the compiles past their budget end: a thread still in xgrammar when the
    interpreter exits aborts it (the engine core leaves by os._exit, a test process cannot)."""
    start = time.monotonic()
    while cache._num_late and time.monotonic() - start < 600:
        time.sleep(0.05)


def test_the_compile_budget_reads_the_compiling_threads_cpu_clock() -> None:
    """A compile starved of CPU on a busy machine is not failed by the budget: its clock, read
    from another thread, counts only the CPU its own thread used."""
    clocks: Future[Callable[[], float]] = Future()
    release = threading.Event()

    def starved_worker() -> None:
        clocks.set_result(_thread_cpu_clock())
        release.wait()

    worker = threading.Thread(target=starved_worker)
    worker.start()
    clock = clocks.result(timeout=10)
    start, spun = clock(), time.thread_time()
    while time.thread_time() - spun < 0.3:
        pass
    assert clock() - start < 0.05
    release.set()
    worker.join()


def test_compile_threads_take_the_lowest_cpu_priority() -> None:
    seen: Future[int] = Future()

    def work() -> None:
        _lowest_priority()
        seen.set_result(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    threading.Thread(target=work).start()
    assert seen.result(timeout=10) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19


def test_bounded_string_schemas_compile_about_as_fast_as_xgrammar_alone(
    tiny_model_dir: Path,
) -> None:
    """vbatch's compile of a schema with long length-bounded strings, against xgrammar's own
    (cache off on both sides, interleaved, medians of 3): within 1.5x, plus 50 ms of noise."""
    from transformers import AutoTokenizer

    from vbatch.grammar_text import json_schema_ebnf

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_model_dir))
    schema = json.dumps(
        {
            "type": "object",
            "properties": {f"s{i}": {"type": "string", "maxLength": 1024} for i in range(3)},
        }
    )
    ours, theirs = [], []
    for _ in range(3):
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=False)
        theirs.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile_grammar(json_schema_ebnf(schema, strict=True))
        ours.append(time.perf_counter() - start)
    assert statistics.median(ours) < 1.5 * statistics.median(theirs) + 0.05, (ours, theirs)


def test_the_engine_fails_a_request_whose_compile_passes_the_budget(tiny_model_dir: Path) -> None:
    from vbatch.config import EngineConfig
    from vbatch.engine.core import EngineCore
    from vbatch.protocol import AddRequest, FinishReason, pack_token_ids
    from vbatch.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_threads=1))
    core.grammars.budget_s = 0.2
    slow = SamplingParams(max_tokens=4, structured={"regex": '[^\\x00-\\x1f"]{0,2002}'})
    small = SamplingParams(max_tokens=4, structured={"choice": ["yes", "no"]})
    for rid, params in (("slow", slow), ("small", small)):
        assert core.add_request(AddRequest(rid, pack_token_ids([1, 500, 77]), params)) == []
    finishes = {}
    while core.has_unfinished():
        finishes.update((f.request_id, f) for f in core.step().finished)
    assert finishes["small"].finish_reason == FinishReason.STOP
    assert finishes["slow"].finish_reason == FinishReason.ERROR
    assert "within the 0.2 s compile budget" in (finishes["slow"].error or "")
    core.shutdown()
    wait_for_late_compiles(core.grammars)


def test_only_a_schema_s_own_patterns_are_checked_for_escapes() -> None:
    """A "pattern" key in data (a default, an example) or a property named so is no regex."""
    from vbatch.grammar_text import json_schema_ebnf

    data = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "examples": [{"pattern": "\\A"}]}},
        "default": {"pattern": "\\Aab"},
    }
    assert json_schema_ebnf(json.dumps(data), True)
    for schema in (
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "\\Zx"}}},
        {"type": "object", "patternProperties": {"\\Ax": {"type": "string"}}},
    ):
        with pytest.raises(ValueError, match="is not supported by the grammar engine"):
            json_schema_ebnf(json.dumps(schema), False)


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [
        ('^"x$', True),
        ("^\\\\$", True),
        ("^a\\nb$", True),
        ("\\u0009", True),
        ("\\x1f", True),
        ("\\x41+\\u00e9", False),
        ('["a]+', False),
        ("^[A-Z]{2}-\\d{3}\\.\\w$", False),
    ],
)
def test_a_schema_pattern_writing_a_quote_backslash_or_control_literal_is_refused(
    pattern: str, refused: bool
) -> None:
    """xgrammar writes a pattern's literals between the string's quotes unescaped: before,
    `^"x$` gave `{"p": ""x"}` and `^\\\\$` an unterminated string, with no error."""
    from vbatch.grammar_text import json_schema_ebnf

    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    if refused:
        with pytest.raises(ValueError, match="cannot be written inside a JSON string"):
            json_schema_ebnf(json.dumps(schema), True)
    else:
        assert json_schema_ebnf(json.dumps(schema), True)
