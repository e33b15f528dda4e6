"""Answer a handful of chats with `LLM.chat` and print them (results in input order)."""

from __future__ import annotations

import argparse

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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="HF model directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with LLM(args.model) as llm:
        for chat, out in zip(CHATS, llm.chat(CHATS, params)):
            print(f"### {chat[-1]['content']}\n{out.outputs[0].text.strip()}\n")


if __name__ == "__main__":
    main()
