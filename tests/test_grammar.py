"""Structured output in the engine core, on the tiny random model: every row honours its
constraint in every sampling mode and scheduling path; bad constraints are error rows."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from vbatch.client.tokenizer import TextTokenizer
from vbatch.config import EngineConfig
from vbatch.engine.core import DEAD_END, EngineCore
from vbatch.models.loader import ResolvedModel
from vbatch.protocol import AddRequest, FinishReason, SampleFinish, pack_token_ids
from vbatch.sampling_params import SamplingParams
from vbatch.structured import StructuredOutput

TIE_TOLERANCE = 1e-4

pytest.importorskip("xgrammar", reason="structured output needs xgrammar")

ROWS = 20
MAX_TOKENS = 160
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["label", "level"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "string", "maxLength": 4},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "word": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["code", "word"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 100},
            {
                "type": "object",
                "properties": {"kind": {"enum": ["a", "b"]}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        ]
    },
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
CHOICES = ["positive", "négatif", 'say "hi"']
GRAMMAR = """root ::= "[" item ("," item){0,3} "]"
item ::= "yes" | "no" | [0-9]{1,3}"""
GRAMMAR_LANGUAGE = re.compile(r"\[(yes|no|[0-9]{1,3})(,(yes|no|[0-9]{1,3})){0,3}\]")


def sampling_modes() -> list[dict]:
    """Row i's sampling: greedy, seeded temperature, top-k/top-p/min-p, penalties, logprobs."""
    return [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.01, "seed": 3},
        {"temperature": 1.2, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"temperature": 0.0, "presence_penalty": 1.0, "logprobs": 3},
    ]


def prompt(i: int) -> list[int]:
    return [1, 500 + i, 77, 1000 + 7 * i]


Results = dict[str, tuple[list[list[int]], list[SampleFinish]]]


def run(
    core: EngineCore,
    requests: dict[str, SamplingParams],
    prompts: Callable[[int], list[int]] = prompt,
) -> Results:
    """Run every request to its end: {request id: ([tokens per sample], [finish per sample])}."""
    tokens: dict[str, dict[int, list[int]]] = {}
    finishes: dict[str, dict[int, SampleFinish]] = {}
    for i, (rid, params) in enumerate(requests.items()):
        finished = core.add_request(AddRequest(rid, pack_token_ids(prompts(i)), params))
        for f in finished:
            finishes.setdefault(f.request_id, {})[f.index] = f
    while core.has_unfinished():
        out = core.step()
        for rid, index, token_id in zip(out.request_ids, out.indices, out.token_ids, strict=True):
            tokens.setdefault(rid, {}).setdefault(index, []).append(token_id)
        for f in out.finished:
            finishes.setdefault(f.request_id, {})[f.index] = f
    return {
        rid: (
            [tokens.get(rid, {}).get(i, []) for i in range(params.n)],
            [finishes[rid][i] for i in sorted(finishes[rid])],
        )
        for rid, params in requests.items()
    }


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def text(tiny_model_dir: Path) -> Callable[[list[int]], str]:
    tokenizer = TextTokenizer.from_dir(tiny_model_dir)

    def decode(token_ids: list[int]) -> str:
        return tokenizer.backend.decode(token_ids, skip_special_tokens=True)

    return decode


def test_every_schema_row_parses_and_validates(
    core: EngineCore, text: Callable[[list[int]], str]
) -> None:
    modes = sampling_modes()
    requests = {
        f"{name}-{i}": SamplingParams(
            max_tokens=MAX_TOKENS,
            structured=StructuredOutput(json_schema=schema),
            **modes[i % len(modes)],
        )
        for name, schema in SCHEMAS.items()
        for i in range(ROWS)
    }
    results = run(core, requests)
    for rid, ([tokens], [finish]) in results.items():
        assert finish.finish_reason == FinishReason.STOP, (rid, finish, text(tokens))
        value = json.loads(text(tokens))
        jsonschema.validate(value, SCHEMAS[rid.rsplit("-", 1)[0]])
    # NOTE: the tiny random model's unconstrained output is not JSON at all.
    free = run(core, {"free": SamplingParams(temperature=0.0, max_tokens=20)})
    with pytest.raises(ValueError):
        json.loads(text(free["free"][0][0]))


def test_regex_choice_and_grammar_rows_always_match(
    core: EngineCore, text: Callable[[list[int]], str]
) -> None:
    modes = sampling_modes()
    specs = {
        "regex": StructuredOutput(regex=REGEX),
        "choice": StructuredOutput(choice=CHOICES),
        "grammar": StructuredOutput(grammar=GRAMMAR),
    }
    requests = {
        f"{kind}-{i}": SamplingParams(max_tokens=64, structured=spec, **modes[i % len(modes)])
        for kind, spec in specs.items()
        for i in range(ROWS)
    }
    for rid, ([tokens], [finish]) in run(core, requests).items():
        assert finish.finish_reason == FinishReason.STOP, rid
        out = text(tokens)
        if rid.startswith("regex"):
            assert re.fullmatch(REGEX, out), out
        elif rid.startswith("choice"):
            assert out in CHOICES
        else:
            assert GRAMMAR_LANGUAGE.fullmatch(out), out


def test_invalid_constraints_are_error_rows_and_others_go_on(core: EngineCore) -> None:
    requests = {
        "bad-regex": SamplingParams(structured=StructuredOutput(regex="((")),
        "bad-schema": SamplingParams(structured=StructuredOutput(json_schema={"type": "frob"})),
        "bad-grammar": SamplingParams(structured=StructuredOutput(grammar="root ::= undefined")),
        "good": SamplingParams(temperature=0.0, structured=StructuredOutput(choice=["a", "b"])),
    }
    results = run(core, requests)
    errors = {rid: finishes[0].error for rid, (_, finishes) in results.items()}
    assert (
        errors["bad-regex"].startswith("invalid regex: ") and "parenthesis" in errors["bad-regex"]
    )
    assert errors["bad-schema"] == 'invalid json_schema: Unsupported type "frob"'
    assert "undefined" in errors["bad-grammar"] and "[" not in errors["bad-grammar"][:3]
    assert all(f.finish_reason == FinishReason.ERROR for f in results["bad-regex"][1])
    assert results["good"][1][0].finish_reason == FinishReason.STOP


def test_constraints_the_grammar_engine_would_break_silently_are_error_rows(
    core: EngineCore,
) -> None:
    """xgrammar reads `\\A` as the letter A (only logging it) and compiles a number range with
    no 6-decimal number in it to an empty rule: before, such rows finished "stop" with text that
    broke their constraint (`AabZ`, `{"v": }`)."""
    narrow = {"type": "number", "minimum": 0.12345678, "maximum": 0.12345679}
    pattern = {"type": "string", "pattern": "\\Aab"}
    requests = {
        "anchors": SamplingParams(structured=StructuredOutput(regex="\\Aab\\Z")),
        "nul": SamplingParams(structured=StructuredOutput(regex="a\\0")),
        "narrow": SamplingParams(structured=StructuredOutput(json_schema=narrow)),
        "pattern": SamplingParams(structured=StructuredOutput(json_schema=pattern)),
        "fine": SamplingParams(
            temperature=0.0, max_tokens=8, structured=StructuredOutput(regex="\\d\\.a\\\\A")
        ),
    }
    results = run(core, requests)
    errors = {rid: finishes[0].error for rid, (_, finishes) in results.items()}
    assert errors["anchors"] == (
        "invalid regex: the regex escape \\A is not supported by the grammar engine, which would "
        "not match what it means"
    )
    assert "escape \\0 is not supported" in errors["nul"]
    assert errors["narrow"].startswith("invalid json_schema: a number range in the schema")
    assert "escape \\A is not supported" in errors["pattern"]
    assert errors["fine"] is None


def test_torch_mask_matches_xgrammars_kernel() -> None:
    """The torch path (for logits off the CPU) forbids exactly what xgrammar's CPU kernel does."""
    import xgrammar

    from vbatch.engine.grammar import apply_bitmask_torch

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 1536), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, 49152, generator=generator)
    expected, got = logits.clone(), logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2])
    apply_bitmask_torch(got, bitmask, [0, 2])
    assert torch.equal(got, expected) and bool(got[1].isfinite().all())


@pytest.mark.gpu
def test_torch_mask_on_cuda_never_waits_for_the_gpu() -> None:
    """The host bitmask and row index reach the GPU through pinned memory, queued."""
    from vbatch.engine.grammar import apply_bitmask_torch

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 1536), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, 49152, generator=generator)
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, [0, 2])
    got = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_bitmask_torch(got, bitmask, [0, 2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), expected)


def test_grammars_are_compiled_once_per_distinct_constraint(core: EngineCore) -> None:
    spec = {"type": "object", "properties": {"n": {"type": "integer"}}}
    first = core.grammars.get(StructuredOutput(json_schema=spec))
    again = core.grammars.get(StructuredOutput(json_schema=json.dumps(spec, indent=2)))
    other = core.grammars.get(StructuredOutput(json_schema={**spec, "required": ["n"]}))
    assert first is again and first is not other


def test_max_tokens_before_the_end_is_length(
    core: EngineCore, text: Callable[[list[int]], str]
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=3, structured=StructuredOutput(json_schema=SCHEMAS["nested"])
    )
    [tokens], [finish] = run(core, {"short": params})["short"]
    assert finish.finish_reason == FinishReason.LENGTH and len(tokens) == 3
    assert text(tokens).startswith('{"')


def test_abort_while_compiling_and_while_running(core: EngineCore) -> None:
    params = SamplingParams(
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        structured=StructuredOutput(json_schema={"type": "array", "items": {"type": "integer"}}),
    )
    assert core.add_request(AddRequest("early", pack_token_ids(prompt(0)), params)) == []
    [finish] = core.abort(["early"])
    assert finish.finish_reason == FinishReason.ABORT and not core.has_unfinished()
    assert core.add_request(AddRequest("late", pack_token_ids(prompt(1)), params)) == []
    while "late" not in core.step().request_ids:
        pass
    [finish] = core.abort(["late"])
    assert finish.finish_reason == FinishReason.ABORT and not core.has_unfinished()


PATH_REQUESTS = {
    f"r{i}": SamplingParams(
        n=2,
        max_tokens=64,
        structured=StructuredOutput(json_schema=SCHEMAS["nested"]),
        **sampling_modes()[i % 2],
    )
    for i in range(4)
}


def long_prompt(i: int) -> list[int]:
    """45 tokens: three blocks, of which the outputs soon need a fourth and a fifth."""
    return [1, *range(300 + 50 * i, 343 + 50 * i), 7]


@pytest.fixture(scope="module")
def path_reference(core: EngineCore) -> Results:
    return run(core, PATH_REQUESTS, long_prompt)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_kv_blocks": 10, "max_num_batched_tokens": 16, "async_scheduling": True},
        pytest.param({"enable_prefix_caching": False}, marks=pytest.mark.slow),
    ],
    ids=["preemption-chunked-prefill-async", "no-prefix-cache"],
)
def test_scheduling_paths_keep_matchers_in_step(
    tiny_model_dir: Path,
    path_reference: Results,
    text: Callable[[list[int]], str],
    overrides: dict,
) -> None:
    """n=2, seeds and greedy under each path give what a plain engine gives, all valid."""
    other = EngineCore(EngineConfig(model=str(tiny_model_dir), **overrides))
    got = run(other, PATH_REQUESTS, long_prompt)
    if "num_kv_blocks" in overrides:
        assert other.stats().num_preemptions > 0
    assert {rid: samples for rid, (samples, _) in got.items()} == {
        rid: samples for rid, (samples, _) in path_reference.items()
    }
    for samples, finishes in got.values():
        for tokens, finish in zip(samples, finishes, strict=True):
            assert finish.finish_reason == FinishReason.STOP
            jsonschema.validate(json.loads(text(tokens)), SCHEMAS["nested"])


def assert_greedy_is_masked_argmax(
    core: EngineCore, model_dir: Path, prompts: list[list[int]], schema: dict
) -> None:
    """Each constrained greedy token is the argmax (up to ties) of transformers' logits under
    the mask that an independent matcher, fed the same tokens, gives at that position; one
    unconstrained greedy row rides along in the same steps."""
    import xgrammar
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab_size = core.model_config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_dir),
        vocab_size=vocab_size,
        stop_token_ids=list(core.model_config.eos_token_ids),
    )
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=schema)
    )
    requests = {f"r{i}": params for i in range(len(prompts))}
    requests["free"] = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = run(core, requests, lambda i: prompts[i % len(prompts)])
    for i, ids in enumerate([*prompts, prompts[0]]):
        [tokens], [finish] = results[f"r{i}" if i < len(prompts) else "free"]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 :]
        matcher = xgrammar.GrammarMatcher(compiled) if i < len(prompts) else None
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        for pos, token_id in enumerate(tokens):
            row = logits[pos : pos + 1].clone()
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask)
                xgrammar.apply_token_bitmask_inplace(row, bitmask)
                assert matcher.accept_token(token_id)
            assert float(row[0, token_id]) >= float(row.max()) - TIE_TOLERANCE, (i, pos)
        if matcher is not None:
            assert finish.finish_reason == FinishReason.STOP and matcher.is_terminated()


def test_greedy_is_the_argmax_of_the_masked_reference_logits(
    tiny_model_dir: Path, core: EngineCore
) -> None:
    assert_greedy_is_masked_argmax(
        core, tiny_model_dir, [prompt(i) for i in range(3)], SCHEMAS["nested"]
    )


EXTRACT_SCHEMA = json.loads(
    (Path(__file__).parents[1] / "examples" / "extract_schema.json").read_text()
)


@pytest.mark.slow
def test_smollm2_greedy_is_the_argmax_of_the_masked_reference_logits(
    smollm2: ResolvedModel, prompts: list[list[int]]
) -> None:
    """On the real model, through the int8 greedy screen's engine: constrained rows bypass it."""
    core = EngineCore(EngineConfig(model=str(smollm2.hf_dir)))
    assert_greedy_is_masked_argmax(core, smollm2.hf_dir, prompts[:3], EXTRACT_SCHEMA)


@pytest.mark.slow
def test_smollm2_seeded_n2_and_preemption_stay_valid(
    smollm2: ResolvedModel, prompts: list[list[int]]
) -> None:
    core = EngineCore(EngineConfig(model=str(smollm2.hf_dir), num_kv_blocks=24))
    tokenizer = TextTokenizer.from_dir(smollm2.hf_dir)
    requests = {
        f"r{i}": SamplingParams(
            n=2,
            max_tokens=MAX_TOKENS,
            structured=StructuredOutput(json_schema=EXTRACT_SCHEMA),
            **sampling_modes()[i % 3],
        )
        for i in range(8)
    }
    results = run(core, requests, lambda i: prompts[i])
    assert core.stats().num_preemptions > 0
    for samples, finishes in results.values():
        for tokens, finish in zip(samples, finishes, strict=True):
            assert finish.finish_reason == FinishReason.STOP
            text = tokenizer.backend.decode(tokens, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), EXTRACT_SCHEMA)


def test_a_constraint_with_no_token_left_ends_its_request_alone(
    core: EngineCore, tiny_model_dir: Path
) -> None:
    """allowed_token_ids keeps "a" but not the end of text that a finished choice needs, so
    after "a" nothing can be sampled. Each such request ends with an ERROR naming why, without
    a token sampled from nothing, and the core goes on with the rest (more of them than the
    failed steps in a row it tolerates)."""
    (a,) = TextTokenizer.from_dir(tiny_model_dir).backend.encode("a", add_special_tokens=False).ids
    stuck = SamplingParams(
        temperature=0.0, allowed_token_ids=[a], structured=StructuredOutput(choice=["a", "b"])
    )
    requests = {f"stuck{i}": stuck for i in range(8)}
    requests |= {f"good{i}": SamplingParams(temperature=0.0, max_tokens=4) for i in range(3)}
    results = run(core, requests)
    for i in range(8):
        tokens, finishes = results[f"stuck{i}"]
        assert [f.finish_reason for f in finishes] == [FinishReason.ERROR]
        assert finishes[0].error == DEAD_END
        assert tokens == [[a]]
    for i in range(3):
        tokens, finishes = results[f"good{i}"]
        assert finishes[0].finish_reason == FinishReason.LENGTH and len(tokens[0]) == 4
