"""Generate answers to a handful of chat prompts with the default model and print them."""

from __future__ import annotations

from vbatch import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Give me three tips for learning a new language."}],
]


def main() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    with LLM() as llm:
        for chat, out in zip(CHATS, llm.generate(CHATS, params)):
            print(f"### {chat[-1]['content']}\n{out.outputs[0].text.strip()}\n")


if __name__ == "__main__":
    main()
