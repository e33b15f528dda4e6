"""SamplingParams.validate: strict types and ranges for every field, so that whatever it accepts
also fits the wire (msgpack, 64-bit ints) and the float32 sampler (torch-free)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from vbatch.errors import SamplingParamsError
from vbatch.protocol import AddRequest, core_decoder, encoder, pack_token_ids
from vbatch.sampling_params import (
    MAX_N,
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from vbatch.structured import StructuredOutput

# NOTE: the values issue 12 found accepted, each then hanging or killing a job.
ISSUE_REPROS = [
    ({"logprobs": True}, "logprobs must be null or an integer"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list of integers"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be true or false"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be true or false"),
    ({"seed": 2**64}, "seed must fit in a 64-bit signed integer"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids must be a list of integers in [0, 2**63)"),
    ({"top_p": 1e-46, "temperature": 1}, "is 0 in float32"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of integers"),
]

MORE_REFUSALS = [
    ({"n": MAX_N + 1}, f"n must be at most {MAX_N}"),
    ({"n": 10**6}, f"n must be at most {MAX_N}"),
    ({"n": True}, "n must be an integer"),
    ({"n": 2.0}, "n must be an integer"),
    ({"max_tokens": "16"}, "max_tokens must be an integer"),
    ({"max_tokens": 2**63}, "max_tokens must fit in a 64-bit signed integer"),
    ({"top_k": 2**70}, "top_k must fit in a 64-bit signed integer"),
    ({"min_tokens": False}, "min_tokens must be an integer"),
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"temperature": math.nan}, "temperature must be finite"),
    ({"temperature": math.inf}, "temperature must be finite"),
    ({"temperature": 1e39}, "temperature must be finite"),
    ({"temperature": 10**400}, "temperature must be finite"),
    ({"top_p": math.nan}, "top_p must be finite"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"min_p": math.nan}, "min_p must be finite"),
    ({"presence_penalty": -math.inf}, "presence_penalty must be finite"),
    ({"frequency_penalty": None}, "frequency_penalty must be a number"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be finite"),
    ({"repetition_penalty": 1e-46}, "repetition_penalty must be > 0"),
    ({"seed": "7"}, "seed must be an integer or null"),
    ({"seed": True}, "seed must be an integer or null"),
    ({"seed": 1.0}, "seed must be an integer or null"),
    ({"seed": -(2**63) - 1}, "seed must fit in a 64-bit signed integer"),
    ({"seed": 2**63}, "seed must fit in a 64-bit signed integer"),
    ({"stop": [""]}, "stop must be a string or a list of non-empty strings"),
    ({"stop": [1]}, "stop must be a string or a list of non-empty strings"),
    ({"stop": {"a": 1}}, "stop must be a string or a list of non-empty strings"),
    ({"stop": ["\ud800"]}, "stop strings must be valid Unicode"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids must be a list of integers"),
    ({"logprobs": 1.0}, "logprobs must be null or an integer"),
    ({"logprobs": 21}, "logprobs must be null or an integer in [0, 20]"),
    ({"ignore_eos": None}, "ignore_eos must be true or false"),
    ({"include_stop_str_in_output": "false"}, "include_stop_str_in_output must be true or false"),
    ({"skip_special_tokens": 0}, "skip_special_tokens must be true or false"),
]


@pytest.mark.parametrize(("overrides", "message"), ISSUE_REPROS + MORE_REFUSALS)
def test_wrong_types_and_ranges_are_refused_with_the_field_named(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(SamplingParamsError, match=None) as info:
        SamplingParams.from_dict(overrides)
    assert message in str(info.value)
    # NOTE: the same value set after construction is refused by the assignment.
    params = SamplingParams()
    with pytest.raises(SamplingParamsError) as info:
        for name, value in overrides.items():
            setattr(params, name, value)
    assert message in str(info.value)


def wire_round_trip(params: SamplingParams) -> SamplingParams:
    msg = core_decoder.decode(encoder.encode(AddRequest("r", pack_token_ids([1]), params)))
    assert isinstance(msg, AddRequest)
    return msg.sampling_params


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n": MAX_N, "seed": -(2**63)},
        {"seed": 2**63 - 1, "stop_token_ids": [0, 2**63 - 1]},
        {"seed": 0, "temperature": 0, "top_p": 1},
        # NOTE: the smallest positive float32 (a subnormal) still keeps the top token.
        {"top_p": 1.5e-45, "temperature": 3.4e38},
        {"repetition_penalty": 1e-44, "presence_penalty": -2, "frequency_penalty": 2},
        {"max_tokens": 2**63 - 1, "min_tokens": 5, "top_k": -1},
        {"logprobs": 0, "stop": "end"},
        {"logprobs": 20, "stop": ("a", "é"), "stop_token_ids": (2, 3)},
        {"ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False},
    ],
)
def test_whatever_is_accepted_fits_the_wire(overrides: dict[str, Any]) -> None:
    params = SamplingParams.from_dict(overrides)
    assert wire_round_trip(params) == params


def test_validate_normalizes_in_place() -> None:
    params = SamplingParams(temperature=1, top_p=1, stop="x", stop_token_ids=(4, 5))  # type: ignore[arg-type]
    assert type(params.temperature) is float and type(params.top_p) is float
    assert params.stop == ["x"] and params.stop_token_ids == [4, 5]
    params.stop = "later"  # type: ignore[assignment]
    params.temperature = 2  # type: ignore[assignment]
    assert params.validate() is params
    assert params.stop == ["later"] and params.temperature == 2.0


def test_stop_token_ids_are_checked_against_the_vocabulary_when_known() -> None:
    params = SamplingParams(stop_token_ids=[10, 49152])
    with pytest.raises(SamplingParamsError, match="below the vocabulary size 49152"):
        params.validate(vocab_size=49152)
    SamplingParams(stop_token_ids=[49151]).validate(vocab_size=49152)


def test_an_assignment_is_validated_and_undone_when_refused() -> None:
    params = SamplingParams(max_tokens=4)
    with pytest.raises(SamplingParamsError, match="max_tokens must be at least 1"):
        params.max_tokens = 0
    assert params.max_tokens == 4
    params.max_tokens = 64
    params.stop = "end"  # type: ignore[assignment]
    assert params.max_tokens == 64 and params.stop == ["end"]
    assert wire_round_trip(params) == params


@pytest.mark.parametrize("field", ["structured_outputs", "guided_decoding", "structured"])
def test_assigning_a_constraint_replaces_it_and_none_clears_it(field: str) -> None:
    """As a vLLM script does after construction: whichever of the three names it uses."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    new = StructuredOutputsParams(regex="b+")
    setattr(params, field, new if field != "structured" else new.to_structured())
    assert params.structured == StructuredOutput(regex="b+")
    setattr(params, field, None)
    assert params.structured is None
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x", "y"]))
    with pytest.raises(SamplingParamsError, match="must be a StructuredOutputsParams"):
        setattr(params, field if field != "structured" else "guided_decoding", "x+")
    assert params.structured == StructuredOutput(choice=["x", "y"])
    assert wire_round_trip(params) == params


def test_a_constraint_given_as_fields_overrides_the_defaults_one_whichever_name() -> None:
    """A job row's `"sampling_params": {"structured_outputs": {"regex": ...}}` under a job-wide
    --regex: once "must be a StructuredOutputsParams", then a clash with a `structured` the row
    never gave; the row's constraint wins, as a row's `structured` does."""
    defaults = SamplingParams(structured=StructuredOutput(regex="[a-z]{3}"))
    for name in ("structured_outputs", "guided_decoding", "structured"):
        row = defaults.updated({name: {"regex": "[0-9]{2}"}})
        assert row.structured == StructuredOutput(regex="[0-9]{2}"), name
    assert SamplingParams(guided_decoding={"choice": ["x", "y"]}).structured == StructuredOutput(
        choice=["x", "y"]
    )
    with pytest.raises(SamplingParamsError, match=r"structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"regexp": "a"})
    # NOTE: vLLM's guided_decoding fields include its backend; vbatch has xgrammar only.
    for backend in (None, "auto", "xgrammar"):
        row = defaults.updated({"guided_decoding": {"regex": "a+", "backend": backend}})
        assert row.structured == StructuredOutput(regex="a+")
    with pytest.raises(SamplingParamsError, match="backend 'outlines' is not available"):
        SamplingParams(guided_decoding={"regex": "a+", "backend": "outlines"})
    with pytest.raises(SamplingParamsError, match="give one of structured, structured_outputs"):
        defaults.updated({"structured": {"regex": "a"}, "structured_outputs": {"regex": "b"}})


def test_vllm_forms_of_its_own_defaults_and_shorthands() -> None:
    """vLLM: seed=-1 is no seed (logprobs=True, which vLLM reads as 1, is refused: types are
    strict since issue 12), its detokenize / logits_processors /
    spaces_between_special_tokens defaults are accepted, and any finite logit bias."""
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(seed=3)
    params.seed = -1
    assert params.seed is None
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamsError, match=f"{name} must be .* got True: pass 1"):
            SamplingParams(**{name: True})
    compat = SamplingParams(
        detokenize=True, logits_processors=None, spaces_between_special_tokens=False
    )
    assert wire_round_trip(compat) == compat
    assert SamplingParams(logit_bias={5: 150}).logit_bias == {5: 150.0}
    with pytest.raises(SamplingParamsError, match="detokenize must be true"):
        SamplingParams(detokenize=False)
    with pytest.raises(SamplingParamsError, match="logits_processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(SamplingParamsError, match="logit_bias values must be finite"):
        SamplingParams(logit_bias={5: 1e39})


def test_from_optional_and_update_from_generation_config_as_vllm() -> None:
    params = SamplingParams.from_optional(temperature=None, max_tokens=None, logit_bias={5: 150})
    assert params.temperature == 1.0 and params.max_tokens == 16
    assert params.logit_bias == {5: 100.0}
    params = SamplingParams(stop_token_ids=[9])
    params.update_from_generation_config({"eos_token_id": [2, 1234]}, model_eos_token_id=2)
    assert params.stop_token_ids == [9, 1234]
    params.update_from_generation_config({"eos_token_id": 1234}, model_eos_token_id=2)
    assert params.stop_token_ids == [9, 1234]
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": [2, 1234]}, model_eos_token_id=2)
    assert ignoring.stop_token_ids == []
