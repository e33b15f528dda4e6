"""vLLM's offline examples, as a vLLM user writes them, on vbatch: basic, chat (one and many
conversations), structured outputs (new and old names), prompt dicts, per-prompt params,
reproducibility; and every input generate/chat cannot use raises."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbatch import LLM, EngineArgs, SamplingParams
from vbatch.errors import ConfigError
from vbatch.lora.request import LoRARequest
from vbatch.pooling_params import PoolingParams
from vbatch.sampling_params import GuidedDecodingParams, StructuredOutputsParams

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(
        model=str(tiny_model_dir),
        tensor_parallel_size=1,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        num_threads=1,
    ) as llm:
        yield llm


def test_basic(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=5))
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert isinstance(output.request_id, str) and output.finished
        (completion,) = output.outputs
        assert completion.finished() and completion.finish_reason in ("stop", "length")
        assert output.prompt_token_ids and completion.token_ids


def test_prompt_dicts_and_token_ids(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Hello, my name is")
    by_text, by_dict, by_ids = llm.generate(
        ["Hello, my name is", {"prompt": "Hello, my name is"}, {"prompt_token_ids": ids}], SHORT
    )
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    (single,) = llm.generate({"prompt": "Hello, my name is"}, SHORT)
    assert single.outputs[0].token_ids == by_text.outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompts", "kind", "needle"),
    [
        (CONVERSATION, ValueError, "LLM.chat"),
        ([{"role": "user", "content": "hi"}, "x"], ValueError, "LLM.chat"),
        ({"text": "Hello"}, ValueError, "'prompt' (str) or 'prompt_token_ids'"),
        ([{"prompt": 5}], TypeError, "'prompt' must be a string"),
        ([{"prompt_token_ids": "12"}], TypeError, "'prompt_token_ids' must be"),
        ([[1, 2, 3]], TypeError, "{'prompt_token_ids': [...]}"),
        ([3.5], TypeError, "each prompt must be"),
    ],
)
def test_inputs_generate_cannot_use_raise_naming_what_it_takes(
    llm: LLM, prompts: object, kind: type[Exception], needle: str
) -> None:
    # NOTE: each of these gave empty error outputs (or completed the word "prompt") before.
    with pytest.raises(kind, match=None) as info:
        llm.generate(prompts, SHORT, use_tqdm=False)
    assert needle in str(info.value)


def test_chat_one_and_many_conversations(llm: LLM) -> None:
    (one,) = llm.chat(CONVERSATION, SHORT, use_tqdm=False)
    assert one.prompt is not None and one.prompt.endswith("<|im_start|>assistant\n")
    assert "higher education" in one.prompt
    many = llm.chat([CONVERSATION, CONVERSATION[:2]], SHORT, use_tqdm=False)
    assert many[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert many[1].prompt is not None and "higher education" not in many[1].prompt
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>"
    (custom,) = llm.chat(CONVERSATION[:2], SHORT, chat_template=template, use_tqdm=False)
    assert custom.prompt == "<system>You are a helpful assistant<user>Hello<bot>"
    partial = [*CONVERSATION[:2], {"role": "assistant", "content": "Well, I"}]
    (cont,) = llm.chat(
        partial, SHORT, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    assert cont.prompt is not None and cont.prompt.endswith("Well, I")
    with pytest.raises(TypeError, match="chat takes one conversation"):
        llm.chat("Hello", SHORT)


def test_a_malformed_conversation_is_an_error_output_in_its_place(llm: LLM) -> None:
    """As a job's rows: a message without a role, an empty conversation or a message that is
    not an object fails its own conversation; before, the call raised for all of them, naming
    none."""
    ok = CONVERSATION[:2]
    outs = llm.chat([ok, [{"content": "x"}], [], [ok[0], "text"], ok], SHORT, use_tqdm=False)
    assert [out.error is None for out in outs] == [True, False, False, False, True]
    assert "messages[0] must have a string 'role'" in (outs[1].error or "")
    assert "non-empty list" in (outs[2].error or "")
    assert "messages[1] must be an object" in (outs[3].error or "")
    assert outs[4].outputs[0].token_ids == outs[0].outputs[0].token_ids
    (alone,) = llm.chat([{"content": "no role"}], SHORT, use_tqdm=False)
    assert "must have a string 'role'" in (alone.error or "")


def test_structured_outputs_new_and_old_names(llm: LLM) -> None:
    pytest.importorskip("xgrammar")
    choices = ["Positive", "Negative"]
    new = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
    old = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=choices))
    regex = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n")
    )
    outs = llm.generate(["Classify: great", "Classify: awful", "Email:"], [new, old, regex])
    assert outs[0].outputs[0].text in choices and outs[1].outputs[0].text in choices
    assert outs[2].outputs[0].finish_reason == "length" or outs[2].outputs[0].text.endswith(
        ".com\n"
    )


def test_logprobs_under_a_constraint_leave_out_what_it_forbids(llm: LLM) -> None:
    """Once "yes" is chosen from ["yes", "no"], the grammar allows few tokens: the rest would
    read -inf, which could not have been chosen (a job's output leaves them out too)."""
    pytest.importorskip("xgrammar")
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    completion = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.logprobs is not None
    entries = [lp for step in completion.logprobs for lp in step.values()]
    assert all(math.isfinite(lp.logprob) for lp in entries)
    assert any(len(step) < 5 for step in completion.logprobs)


def test_per_prompt_params_and_their_count(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in (2, 5)]
    outs = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], params)


def test_reproducibility_with_seeds(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=8, ignore_eos=True)
    first = llm.generate(["Hello, my name is"] * 2, params, use_tqdm=False)
    again = llm.generate(["Hello, my name is"], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids


def test_sampling_params_as_vllm_scripts_use_them(llm: LLM) -> None:
    params = llm.get_default_sampling_params()
    params.max_tokens = 4
    params.temperature = 0.0
    params.logprobs = 2
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy: the top token
        assert sorted(e.rank for e in entry.values()) == [1, 2]
        assert isinstance(entry[token_id].decoded_token, str)
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )
    params.temperature = 1.0
    params.seed = 5
    params.logprobs = 0
    (sampled,) = llm.generate("Hello", params, use_tqdm=False)
    for token_id, entry in zip(sampled.outputs[0].token_ids, sampled.outputs[0].logprobs or []):
        assert entry[token_id].rank is not None and entry[token_id].rank >= 1
    clone = params.clone()
    clone.max_tokens = None
    clone.truncate_prompt_tokens = 2
    clone.logprobs = None
    clone.max_tokens = 3
    (cut,) = llm.generate("one two three four five", clone, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 2 and params.max_tokens == 4
    with pytest.raises(ValueError, match="logprobs=-1"):
        params.logprobs = -1


def test_max_tokens_none_runs_to_the_model_length(llm: LLM) -> None:
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [1] * 250}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_bad_words_and_allowed_tokens_reach_the_output(llm: LLM) -> None:
    (free,) = llm.generate("Hello", SHORT, use_tqdm=False)
    banned = llm.get_tokenizer().decode(free.outputs[0].token_ids[:1]).strip()
    params = SHORT.clone()
    params.bad_words = [banned]
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    assert out.outputs[0].token_ids[0] != free.outputs[0].token_ids[0]
    allowed = SHORT.clone()
    allowed.allowed_token_ids = [100, 200]
    (only,) = llm.generate("Hello", allowed, use_tqdm=False)
    assert set(only.outputs[0].token_ids) <= {100, 200}


def test_get_tokenizer_as_transformers(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert isinstance(text, str) and ids == tokenizer.encode(text, add_special_tokens=False)
    (via_chat,) = llm.chat(CONVERSATION, SHORT, use_tqdm=False)
    assert via_chat.prompt == text
    # NOTE: as transformers' own tokenizer of the same files, without tensors.
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(llm.model.hf_dir)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, name) == getattr(reference, name), name
        assert getattr(tokenizer, f"{name}_id") == getattr(reference, f"{name}_id"), name
    texts = ["Hello there", "a"]
    assert tokenizer(texts[0]) == {k: v for k, v in reference(texts[0]).items()}
    assert tokenizer(texts)["input_ids"] == reference(texts)["input_ids"]
    ids = tokenizer(texts)["input_ids"]
    assert tokenizer.batch_decode(ids) == reference.batch_decode(ids)
    one = ids[0][0]
    assert tokenizer.decode(one) == reference.decode(one)
    assert tokenizer.convert_ids_to_tokens(one) == reference.convert_ids_to_tokens(one)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == reference.convert_ids_to_tokens(ids[0])
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        tokenizer.apply_chat_template(
            CONVERSATION, add_generation_prompt=True, continue_final_message=True
        )
    # NOTE: return_dict, and a list of conversations, as transformers gives them without tensors.
    want = reference.apply_chat_template(CONVERSATION, return_dict=True)
    assert tokenizer.apply_chat_template(CONVERSATION, return_dict=True) == dict(want)
    batch = [CONVERSATION, CONVERSATION[1:2]]
    assert tokenizer.apply_chat_template(batch, tokenize=False) == reference.apply_chat_template(
        batch, tokenize=False
    )
    assert tokenizer.apply_chat_template(batch, return_dict=True)["input_ids"] == list(
        reference.apply_chat_template(batch, return_dict=True)["input_ids"]
    )
    with pytest.raises(ValueError, match="return_tensors is not supported"):
        tokenizer.apply_chat_template(CONVERSATION, return_tensors="pt")
    for bad in ([{"content": "x"}], "hello"):
        with pytest.raises(ValueError, match="messages"):
            tokenizer.apply_chat_template(bad, tokenize=False)


def test_vllm_defaults_of_none_and_truncation_to_the_model_length(llm: LLM) -> None:
    params = SamplingParams(
        stop=None, stop_token_ids=None, bad_words=None, max_tokens=2, temperature=0.0
    )
    assert (params.stop, params.stop_token_ids, params.bad_words) == ([], [], [])
    long_prompt = {"prompt_token_ids": list(range(5, 305))}
    (refused,) = llm.generate(long_prompt, params, use_tqdm=False)
    assert refused.error is not None and "300 tokens" in refused.error
    (kept,) = llm.embed(long_prompt, truncate_prompt_tokens=-1, use_tqdm=False)
    assert kept.error is None and kept.prompt_token_ids == list(range(49, 305))
    with pytest.raises(ValueError, match="-1"):
        SamplingParams(truncate_prompt_tokens=-2)


def test_pooling_calls_take_vllms_arguments_and_prompt_forms(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Hello there")
    by_text, by_dict, by_ids = llm.embed(
        ["Hello there", {"prompt": "Hello there"}, {"prompt_token_ids": ids}], use_tqdm=False
    )
    assert by_text.outputs.embedding == by_dict.outputs.embedding == by_ids.outputs.embedding
    (short,) = llm.embed("Hello there", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert len(short.outputs.embedding) == 8
    (named,) = llm.encode("Hello there", PoolingParams(task="embed"), use_tqdm=False)
    (default,) = llm.encode("Hello there", use_tqdm=False)
    (by_task,) = llm.encode("Hello there", pooling_task="embed", use_tqdm=False)
    assert named.error is None and by_text.outputs.embedding == named.outputs.data.tolist()
    assert (
        default.outputs.data.tolist()
        == by_task.outputs.data.tolist()
        == named.outputs.data.tolist()
    )
    with pytest.raises(ValueError, match="task must be"):
        PoolingParams(task="summarize")
    empty, fine = llm.embed(["", "x"], use_tqdm=False)
    assert empty.error == "the prompt is empty" and fine.error is None
    (scored,) = llm.score("a", [""], use_tqdm=False)
    assert scored.error == "the prompt is empty" and math.isnan(scored.outputs.score)


def test_chat_takes_tools_and_lora_requests(llm: LLM) -> None:
    template = "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ messages[-1].content }}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (out,) = llm.chat(CONVERSATION[1:2], SHORT, chat_template=template, tools=tools, use_tqdm=False)
    assert out.prompt == "[1 tools]Hello"
    adapter = LoRARequest("a", 1, "/nonexistent")
    (refused,) = llm.chat(CONVERSATION[1:2], SHORT, lora_request=adapter, use_tqdm=False)
    assert refused.error is not None and "enable_lora=True" in refused.error
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], SHORT, lora_request=[None], use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or a list"):
        llm.generate(["a"], SHORT, lora_request={"name": "x"}, use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tensor_parallel_size": 2}, "data_parallel_size"),
        ({"dtype": "fp7"}, "dtype must be one of"),
        ({"no_such_arg": 1}, "accepted: "),
    ],
)
def test_llm_arguments_vbatch_cannot_take_name_the_equivalent(
    tiny_model_dir: Path, kwargs: dict, needle: str
) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        LLM(str(tiny_model_dir), **kwargs)
    assert needle in str(info.value)


def test_engine_args_parse_back_into_llm_arguments() -> None:
    from vbatch.engine_args import map_llm_args

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int)
    argv = ["--dtype", "half", "--max-num-seqs", "4", "--max-tokens", "3", "--block-size", "32"]
    argv += ["--kv-cache-dtype", "bfloat16", "--quantization", "int8"]
    argv += ["--num-gpu-blocks-override", "64", "--pipeline-parallel-size", "1"]
    args = vars(parser.parse_args(argv))
    assert args.pop("max_tokens") == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = frozenset({"model", "data_parallel_size"})
        settings = map_llm_args({k: v for k, v in args.items() if k not in own}, own)
    assert settings.engine["dtype"] == "float16" and settings.engine["max_num_seqs"] == 4
    assert (settings.engine["block_size"], settings.engine["kv_cache_dtype"]) == (32, "bfloat16")
    assert (settings.engine["quantization"], settings.engine["num_kv_blocks"]) == ("int8", 64)
    assert settings.engine["async_scheduling"] is False
    assert map_llm_args({"generation_config": None}, frozenset()).generation_config == "vllm"
    with pytest.raises(ConfigError, match="generation_config must be"):
        map_llm_args({"generation_config": 3}, frozenset())
    with pytest.warns(UserWarning, match="swap_space"):
        map_llm_args({"swap_space": 4, "disable_log_stats": True}, frozenset())


def test_a_vllm_script_runs_with_its_import_changed(tiny_model_dir: Path, tmp_path: Path) -> None:
    # NOTE: vLLM's generate example, only `vllm` changed to `vbatch` and its parser to argparse.
    script = tmp_path / "generate.py"
    script.write_text(
        textwrap.dedent(
            """
            from argparse import ArgumentParser
            from vbatch import LLM, EngineArgs

            def create_parser():
                parser = ArgumentParser()
                EngineArgs.add_cli_args(parser)
                sampling_group = parser.add_argument_group("Sampling parameters")
                sampling_group.add_argument("--max-tokens", type=int)
                sampling_group.add_argument("--temperature", type=float)
                return parser

            def main(args: dict):
                max_tokens = args.pop("max_tokens")
                temperature = args.pop("temperature")
                llm = LLM(**args)
                sampling_params = llm.get_default_sampling_params()
                if max_tokens is not None:
                    sampling_params.max_tokens = max_tokens
                if temperature is not None:
                    sampling_params.temperature = temperature
                prompts = ["Hello, my name is", "The future of AI is"]
                outputs = llm.generate(prompts, sampling_params)
                for output in outputs:
                    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")

            if __name__ == "__main__":
                parser = create_parser()
                args: dict = vars(parser.parse_args())
                main(args)
            """
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--model",
            str(tiny_model_dir),
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("Generated text:") == 2


@pytest.mark.slow
def test_vllm_examples_on_the_default_model() -> None:
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"brand": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["brand", "year"],
    }
    with LLM(max_num_seqs=8) as llm:
        (chat,) = llm.chat(CONVERSATION, SamplingParams(temperature=0.5, max_tokens=16))
        assert chat.outputs[0].text
        params = SamplingParams(
            temperature=0.0,
            max_tokens=64,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        (car,) = llm.generate("Describe a famous car as JSON with its brand and year.", params)
    assert set(json.loads(car.outputs[0].text)) == {"brand", "year"}


def test_vllm_keywords_scripts_pass_are_taken(llm: LLM) -> None:
    made: list[dict] = []

    def quiet_bar(**kwargs: object) -> object:
        from tqdm import tqdm

        made.append(kwargs)
        return tqdm(**{**kwargs, "disable": True})

    plain = llm.generate(["Hello"], SHORT, use_tqdm=False)[0]
    (out,) = llm.generate(["Hello"], SHORT, use_tqdm=quiet_bar, priority=[0])
    assert made and made[0]["total"] == 1
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics is None and out.lora_request is None
    with pytest.raises(ValueError, match="every priority must be 0"):
        llm.generate(["Hello"], SHORT, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(["Hello"], SHORT, use_tqdm=False, priority=[0, 0])
    (openai,) = llm.chat(
        CONVERSATION[:2],
        SHORT,
        use_tqdm=False,
        chat_template="{% for m in messages %}{% for p in m.content %}[{{ p.text }}]"
        "{% endfor %}{% endfor %}",
        chat_template_content_format="openai",
    )
    assert openai.prompt == "[You are a helpful assistant][Hello]"
    partial = [*CONVERSATION[:2], {"role": "assistant", "content": "A"}]
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(partial, SHORT, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(CONVERSATION[:2], SHORT, use_tqdm=False, chat_template_content_format="x")


def test_cache_salt_keeps_prefix_cache_blocks_apart(llm: LLM) -> None:
    ids = list(range(5, 5 + 100))
    first = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, SHORT, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, SHORT, use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": ids, "cache_salt": "b"}, SHORT, use_tqdm=False)[0]
    unsalted = llm.generate({"prompt_token_ids": ids}, SHORT, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    with pytest.raises(TypeError, match="cache_salt"):
        llm.generate({"prompt": "x", "cache_salt": 3}, SHORT, use_tqdm=False)
    # NOTE: with prompt_logprobs, the prompt's blocks (hashed for its prefill) are the salt's too.
    scored = SHORT.clone()
    scored.prompt_logprobs = 1
    ids = list(range(300, 300 + 100))
    salted = llm.generate({"prompt_token_ids": ids, "cache_salt": "c"}, scored, use_tqdm=False)[0]
    unsalted = llm.generate({"prompt_token_ids": ids}, SHORT, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": ids, "cache_salt": "c"}, SHORT, use_tqdm=False)[0]
    assert salted.prompt_logprobs is not None and unsalted.num_cached_tokens == 0
    assert again.num_cached_tokens > 0


def test_structured_outputs_params_take_vllms_switches() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for kwargs in (
        {"disable_any_whitespace": True},
        {"disable_additional_properties": True},
        {"disable_fallback": True},
    ):
        params = StructuredOutputsParams(json=schema, **kwargs)
        assert params.to_structured() == StructuredOutputsParams(json=schema).to_structured()
    assert GuidedDecodingParams(choice=["a", "b"], backend="xgrammar").to_structured().choice
    with pytest.raises(ValueError, match="xgrammar"):
        GuidedDecodingParams(choice=["a"], backend="outlines")
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json=schema, whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"type": "structural_tag"}')


def test_seed_minus_one_samples_afresh_each_call(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    runs = [llm.generate("Hello", p, use_tqdm=False)[0].outputs[0].token_ids for p in (params,) * 2]
    fixed = [
        llm.generate("Hello", p, use_tqdm=False)[0].outputs[0].token_ids for p in (seeded,) * 2
    ]
    assert runs[0] != runs[1] and fixed[0] == fixed[1]


def test_bad_words_ban_the_spaced_form_only_where_vllm_does(llm: LLM) -> None:
    """vLLM bans a bad word's form after a space only where it is as many tokens and starts
    with another token: "Teens" is 2 tokens and " Teens" 1, so " Teens" stays allowed."""
    tokenizer = llm.get_tokenizer()
    bare, spaced = (tokenizer.encode(t, add_special_tokens=False) for t in ("Teens", " Teens"))
    assert len(bare) == 2 and len(spaced) == 1
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={spaced[0]: 100}
    )
    params.bad_words = ["Teens"]
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    assert out.outputs[0].token_ids == spaced * 3
    one_token = tokenizer.decode(spaced).strip()
    both = tokenizer.encode(" " + one_token, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={both[0]: 100}
    )
    params.bad_words = [one_token]
    if len(tokenizer.encode(one_token, add_special_tokens=False)) == 1:
        (out,) = llm.generate("Hello", params, use_tqdm=False)
        assert both[0] not in out.outputs[0].token_ids


def test_invalid_sampling_defaults_in_generation_config(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The API names the file and the way past it; a job, whose rows never take those
    defaults, runs (every CLI job failed, and kept a job that no resume could finish)."""
    from vbatch.engine_args import default_sampling_params
    from vbatch.job.runner import JobSpec, RunOptions, start_job

    model = tmp_path / "bad-defaults"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "temperature": -1}))
    with pytest.raises(
        ConfigError,
        match=rf"{config_path}: its sampling defaults are invalid \(temperature must be >= 0",
    ):
        default_sampling_params(model, "auto")
    assert default_sampling_params(model, "vllm") == SamplingParams()
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "Hello"}\n')
    job = JobSpec(
        input_path,
        tmp_path / "out.jsonl",
        model=str(model),
        sampling={"max_tokens": 2, "temperature": 0.0},
        engine_args={"num_threads": 1},
    )
    outcome = start_job(job, RunOptions(display="quiet"))
    assert outcome.exit_code == 0, outcome.message
    assert json.loads((tmp_path / "out.jsonl").read_text())["error"] is None


def test_a_generation_config_eos_is_the_stop_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model whose generation_config.json lists a second EOS id: a sample ending on it stops
    with that id as its stop_reason (vLLM makes it a stop token id); on the tokenizer's EOS,
    None."""
    model = tmp_path / "two-eos"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [2, 1234]
    config_path.write_text(json.dumps(config))
    with LLM(str(model), num_threads=1, max_model_len=128) as two:
        (other, primary) = two.generate(
            ["Hello", "Hello"],
            [
                SamplingParams(temperature=0.0, max_tokens=4, logit_bias={1234: 100}),
                SamplingParams(temperature=0.0, max_tokens=4, logit_bias={2: 100}),
            ],
            use_tqdm=False,
        )
        (structured,) = two.generate(
            "Hello",
            SamplingParams(
                temperature=0.0,
                max_tokens=4,
                logit_bias={1234: 100},
                structured_outputs=StructuredOutputsParams(regex="a?"),
            ),
            use_tqdm=False,
        )
    assert other.outputs[0].token_ids == [1234] and other.outputs[0].stop_reason == 1234
    assert other.outputs[0].finish_reason == "stop" and other.outputs[0].text == ""
    assert primary.outputs[0].token_ids == [2] and primary.outputs[0].stop_reason is None
    assert structured.outputs[0].stop_reason == 1234


def test_chat_takes_vllms_positional_order_and_template_kwargs_overrides(llm: LLM) -> None:
    template = (
        "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ messages[-1].content }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    (plain,) = llm.chat(CONVERSATION[1:2], SHORT, False, None, template)
    assert plain.prompt == "Hello>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (over,) = llm.chat(
        CONVERSATION[1:2],
        SHORT,
        use_tqdm=False,
        chat_template_kwargs={
            "chat_template": template,
            "add_generation_prompt": False,
            "tools": tools,
        },
    )
    assert over.prompt == "[1 tools]Hello"
    with pytest.raises(ValueError, match="may not set 'messages'"):
        llm.chat(CONVERSATION[1:2], SHORT, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_greedy_frequency_and_presence_penalties_apply_from_the_second_token(llm: LLM) -> None:
    """A greedy row's penalties subtract nothing at its first token; the steps after it must still
    apply them (a reused plain-greedy step skipped them), the same with logprobs asked or not."""
    plain = SamplingParams(temperature=0, max_tokens=6)
    (free,) = llm.generate(["Hello"], plain)
    assert len(set(free.outputs[0].token_ids)) < 6
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        params = plain.updated(penalty)
        (out,) = llm.generate(["Hello"], params)
        (with_logprobs,) = llm.generate(["Hello"], params.updated({"logprobs": 1}))
        tokens = out.outputs[0].token_ids
        assert tokens == with_logprobs.outputs[0].token_ids, penalty
        assert len(set(tokens)) == 6, (penalty, tokens)


def test_a_cut_that_leaves_a_text_no_room_beside_its_special_tokens_is_an_error_output(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a tokenizer that adds [CLS] and [SEP]: before, a cut to 1 or 2 kept only those, and
    a CLS-pooled embedding pooled them silently."""
    monkeypatch.setattr(llm.tokenizer, "_added_around", (1, 1))
    text = "a text of several tokens"
    cut, kept = llm.generate(
        [text, text],
        [SamplingParams(truncate_prompt_tokens=k, max_tokens=1) for k in (2, 3)],
        use_tqdm=False,
    )
    assert cut.error is not None and "truncate_prompt_tokens=2 leaves no room" in cut.error
    assert kept.error is None and len(kept.prompt_token_ids) == 3
    (embedded,) = llm.embed(text, truncate_prompt_tokens=2, use_tqdm=False)
    assert embedded.error is not None and "leaves no room" in embedded.error
    # NOTE: past the model's length, as vLLM refuses it (the error named the option as the fix).
    past = SamplingParams(truncate_prompt_tokens=10**6, max_tokens=1)
    for out in (*llm.generate(text, past), *llm.embed(text, truncate_prompt_tokens=10**6)):
        assert "truncate_prompt_tokens=1000000 is more than the maximum model length" in str(
            out.error
        )
