"""Structured output costs: vbatch's schema compile against xgrammar's own, xgrammar against
llguidance (compile, per-step mask; when llguidance is installed) and the decode step at batch 64
with a nested JSON schema against the same step unconstrained, side by side.

    python benchmarks/structured.py [--model PATH] [--batch 64] [--steps 24] [--schemas 1000]
        [--e2e-rows 256] [--e2e-max-tokens 64] [--skip-steps]

Like is compared with like: both sides of every comparison take the same LM-head path (the int8
greedy screen is off on both, as constrained steps never take it) and produce the same number of
tokens. The end-to-end part times `vbatch run` (the CLI, in a subprocess) on the same rows with
`--json-schema`, then without it, each row then generating exactly as many tokens (`ignore_eos`,
its `max_tokens` set to the constrained row's count), and prints the cost per output token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

NESTED = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "maxLength": 40},
                    "role": {"enum": ["engineer", "nurse", "teacher", "other"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "age", "email", "role", "tags"],
                "additionalProperties": False,
            },
        },
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["people", "summary"],
    "additionalProperties": False,
}
PERSON = {"name": "Maria Lopez", "age": 34, "email": "maria@example.com", "role": "nurse"}
# NOTE: the separators xgrammar uses without any_whitespace, so both accept the same text.
LLG_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DOCUMENT = {"people": [{**PERSON, "tags": ["a", "b"]}] * 6, "summary": "Six people."}


def small_schema(i: int) -> dict[str, Any]:
    """The i-th of many distinct small schemas: names and bounds vary."""
    return {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 10 + i},
            "label": {"enum": [f"a{i}", f"b{i}", "c"]},
            "note": {"type": "string", "maxLength": 5 + i % 20},
        },
        "required": [f"field_{i}", "label"],
        "additionalProperties": False,
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


BOUNDED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 4096},
        "note": {"type": ["string", "null"], "minLength": 1, "maxLength": 512},
    },
    "required": ["title"],
}


def compile_costs(hf_dir: Path, vocab_size: int, eos: list[int]) -> None:
    """vbatch's JSON schema compile (xgrammar, its length-bounded string rule narrowed in the
    EBNF) against xgrammar's own compile of the same schema; cache off, interleaved, medians."""
    import xgrammar
    from transformers import AutoTokenizer

    from vbatch.engine.grammar import json_schema_ebnf

    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(hf_dir), vocab_size=vocab_size, stop_token_ids=eos
    )
    print("schema compile, vbatch against xgrammar alone (1 thread, cache off, median of 5):")
    for name, schema in (("nested", NESTED), ("maxLength 4096", BOUNDED)):
        text = json.dumps(schema)
        ours, theirs = [], []
        for _ in range(5):
            compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            theirs.append(
                timed(lambda c=compiler, t=text: c.compile_json_schema(t, any_whitespace=False))[1]
            )
            ours.append(
                timed(lambda c=compiler, t=text: c.compile_grammar(json_schema_ebnf(t, True)))[1]
            )
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"  {name:15s} vbatch {a * 1e3:8.1f} ms  xgrammar {b * 1e3:8.1f} ms  ({a / b:.2f}x)")


def grammar_engines(hf_dir: Path, vocab_size: int, eos: list[int]) -> None:
    """Compile time (1 nested schema, N small ones) and batch mask time, both engines."""
    try:
        import llguidance
    except ImportError:
        print("llguidance is not installed: xgrammar against llguidance skipped")
        return
    import llguidance.hf
    import llguidance.torch
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    xgr_info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos
    )
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    doc_tokens = [*tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False), eos[0]]

    def xgr_compile(schema: dict[str, Any]) -> Any:
        compiler = xgrammar.GrammarCompiler(xgr_info, max_threads=1, cache_enabled=False)
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(grammar)
        matcher.fill_next_token_bitmask(xgrammar.allocate_token_bitmask(1, vocab_size))
        return grammar

    def llg_compile(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=LLG_OPTIONS)
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
        llguidance.torch.fill_next_token_bitmask(
            matcher, llguidance.torch.allocate_token_bitmask(1, vocab_size)
        )
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    print("compile, first mask included (1 thread):")
    for name, compile_one in (("xgrammar", xgr_compile), ("llguidance", llg_compile)):
        _, one = timed(lambda compile_one=compile_one: compile_one(NESTED))
        _, many = timed(
            lambda compile_one=compile_one: [
                compile_one(small_schema(i)) for i in range(ARGS.schemas)
            ]
        )
        print(f"  {name:10s} nested schema {one * 1e3:7.1f} ms; {ARGS.schemas} small schemas "
              f"{many:6.2f} s ({many / ARGS.schemas * 1e3:.2f} ms each)")  # fmt: skip

    batch = ARGS.batch
    xgr_grammar = xgrammar.GrammarCompiler(xgr_info).compile_json_schema(
        json.dumps(NESTED), any_whitespace=False
    )
    llg_grammar = llguidance.LLMatcher.grammar_from_json_schema(NESTED, defaults=LLG_OPTIONS)
    xgr_matchers = [xgrammar.GrammarMatcher(xgr_grammar) for _ in range(batch)]
    llg_matchers = [llguidance.LLMatcher(llg_tokenizer, llg_grammar) for _ in range(batch)]
    xgr_fill = xgrammar.BatchGrammarMatcher(max_threads=1)
    llg_exec = llguidance.LLExecutor(num_threads=1)
    bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
    rows = list(range(batch))
    xgr_times, llg_times = [], []
    for token in doc_tokens:
        _, t = timed(lambda: xgr_fill.batch_fill_next_token_bitmask(xgr_matchers, bitmask, rows))
        xgr_times.append(t)
        xgr_mask = bitmask.clone()
        pairs = [(m, i) for i, m in enumerate(llg_matchers)]
        _, t = timed(
            lambda pairs=pairs: llguidance.torch.fill_next_token_bitmask_par(
                llg_exec, pairs, bitmask
            )
        )
        llg_times.append(t)
        assert bool((xgr_mask[:, token // 32] >> (token % 32) & 1).all())
        for m in xgr_matchers:
            assert m.accept_token(token)
        for m in llg_matchers:
            assert m.consume_token(token)
    print(f"mask fill, batch {batch}, nested schema, {len(doc_tokens)} steps (1 thread):")
    for name, times in (("xgrammar", xgr_times), ("llguidance", llg_times)):
        print(f"  {name:10s} median {statistics.median(times) * 1e3:6.2f} ms/step, "
              f"max {max(times) * 1e3:6.2f} ms")  # fmt: skip


def decode_steps(hf_dir: Path) -> None:
    """Batch-64 decode steps of two engines, stepped alternately so load drift hits both."""
    from vbatch.config import EngineConfig
    from vbatch.engine.core import EngineCore
    from vbatch.protocol import AddRequest, pack_token_ids
    from vbatch.sampling_params import SamplingParams
    from vbatch.structured import StructuredOutput

    free = SamplingParams(temperature=ARGS.temperature, max_tokens=512, ignore_eos=True)
    constrained = SamplingParams(
        temperature=ARGS.temperature,
        max_tokens=512,
        structured=StructuredOutput(json_schema=NESTED),
    )
    engines = {}
    for name, params in (("unconstrained", free), ("structured", constrained)):
        # NOTE: the int8 greedy screen off on both sides: constrained steps never take it.
        config = EngineConfig(model=str(hf_dir), num_threads=ARGS.threads, greedy_screen=False)
        core = EngineCore(config)
        for i in range(ARGS.batch):
            prompt = [1, 4093, 1132 + i, 28, 253, 2]
            core.add_request(AddRequest(f"{name}{i}", pack_token_ids(prompt), params))
        while True:
            out = core.step()
            if len(out.request_ids) == ARGS.batch:
                break
        engines[name] = core
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ARGS.steps):
        for name, core in engines.items():
            out, t = timed(core.step)
            assert len(out.request_ids) == ARGS.batch and not out.finished, name
            times[name].append(t)
    base = statistics.median(times["unconstrained"])
    print(f"decode step, batch {ARGS.batch}, temperature {ARGS.temperature}, {ARGS.steps} steps "
          "each, alternating, fp32 LM head on both:")  # fmt: skip
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:13s} median {median * 1e3:7.1f} ms/step  ({median / base:.3f}x)")


def run_job(workdir: Path, rows: Path, extra: list[str]) -> tuple[float, list[int]]:
    """One `vbatch run` over `rows`, the int8 greedy screen off: (wall seconds, each row's
    completion tokens in input order)."""
    out = workdir / f"out-{rows.stem}.jsonl"
    cmd = [sys.executable, "-m", "vbatch", "run", str(rows), "-o", str(out), "--overwrite"]
    cmd += ["--max-tokens", str(ARGS.e2e_max_tokens), "--num-threads", str(ARGS.threads), "-q"]
    cmd += ["--no-greedy-screen", "--ordered"]
    if ARGS.model:
        cmd += ["--model", ARGS.model]
    start = time.perf_counter()
    subprocess.run([*cmd, *extra], check=True, env=os.environ.copy())
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return wall, [line["completion_tokens"] for line in lines]


def end_to_end() -> None:
    """`vbatch run` on the same rows, constrained by one schema and unconstrained."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        rows = workdir / "rows.jsonl"
        prompts = [
            f"Describe person {i} as JSON with name, age and role." for i in range(ARGS.e2e_rows)
        ]
        rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        schema = workdir / "schema.json"
        schema.write_text(json.dumps(NESTED["properties"]["people"]["items"]))
        # NOTE: a first run may build the native kernels and convert the GGUF; keep that out.
        warm = workdir / "warm.jsonl"
        warm.write_text(rows.read_text().splitlines()[0] + "\n")
        run_job(workdir, warm, ["--json-schema", str(schema)])
        json_s, json_counts = run_job(workdir, rows, ["--json-schema", str(schema)])
        # NOTE: each unconstrained row makes exactly its constrained twin's number of tokens.
        same = workdir / "same.jsonl"
        same.write_text(
            "".join(
                json.dumps({"prompt": p, "sampling_params": {"max_tokens": n, "ignore_eos": True}})
                + "\n"
                for p, n in zip(prompts, json_counts, strict=True)
            )
        )
        plain_s, plain_counts = run_job(workdir, same, [])
    assert plain_counts == json_counts, "the two runs made different numbers of tokens"
    tokens = sum(json_counts)
    print(f"end to end, {ARGS.e2e_rows} rows, {tokens} output tokens on each side, "
          "int8 screen off on both:")  # fmt: skip
    print(f"  unconstrained {plain_s:.1f} s = {plain_s / tokens * 1e3:.2f} ms/token")
    print(f"  --json-schema {json_s:.1f} s = {json_s / tokens * 1e3:.2f} ms/token")
    print(f"  ratio (structured / unconstrained time per token): {json_s / plain_s:.3f}")


def main() -> None:
    from vbatch.models.config import ModelConfig
    from vbatch.models.loader import resolve_model

    resolved = resolve_model(ARGS.model)
    config = ModelConfig.from_hf_dir(resolved.hf_dir)
    torch.set_num_threads(ARGS.threads)
    compile_costs(resolved.hf_dir, config.vocab_size, list(config.eos_token_ids))
    if not ARGS.skip_steps:
        grammar_engines(resolved.hf_dir, config.vocab_size, list(config.eos_token_ids))
        decode_steps(resolved.hf_dir)
    if ARGS.e2e_rows:
        end_to_end()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--schemas", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--e2e-rows", type=int, default=256)
    parser.add_argument("--e2e-max-tokens", type=int, default=64)
    parser.add_argument("--skip-steps", action="store_true")
    ARGS = parser.parse_args()
    main()
