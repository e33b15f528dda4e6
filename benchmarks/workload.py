"""The deterministic throughput workload shared by the benchmarks: chat prompts of 20-400 tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "the history of bridges",
    "how bees make honey",
    "the rules of chess",
    "why the moon has phases",
    "how a bicycle stays upright",
    "the water cycle",
    "how vaccines train the immune system",
    "the invention of the printing press",
    "what makes bread rise",
    "how glaciers shape valleys",
    "the life cycle of a star",
    "how a refrigerator keeps food cold",
    "why leaves change colour in autumn",
    "how compilers turn code into programs",
    "the basics of supply and demand",
    "how birds migrate",
]
WORDS = [
    "river",
    "mountain",
    "signal",
    "garden",
    "engine",
    "library",
    "window",
    "harvest",
    "lantern",
    "market",
    "orbit",
    "thunder",
    "pencil",
    "harbor",
    "meadow",
    "circuit",
    "castle",
    "forest",
    "planet",
    "candle",
    "bridge",
    "mirror",
    "village",
    "rocket",
    "ocean",
    "valley",
    "compass",
    "ladder",
    "feather",
    "tunnel",
    "anchor",
    "season",
]


def make_messages(num_prompts: int = 128, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat prompts whose lengths spread over roughly 20 to 400 tokens."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        topic = TOPICS[i % len(TOPICS)]
        num_words = int(rng.uniform(0, 1) ** 1.5 * 300)
        notes = " ".join(rng.choice(WORDS) for _ in range(num_words))
        question = f"Explain {topic} in a short paragraph."
        if notes:
            question = f"Here are some notes: {notes}.\n\n{question}"
        prompts.append([{"role": "user", "content": question}])
    return prompts


def chat_token_ids(hf_dir: str, num_prompts: int) -> list[list[int]]:
    """make_messages(num_prompts) through the chat template of the tokenizer in `hf_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = []
    for messages in make_messages(num_prompts):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return prompts


def write_jsonl(path: Path, num_prompts: int = 128, seed: int = 0) -> Path:
    with open(path, "w") as f:
        for i, messages in enumerate(make_messages(num_prompts, seed)):
            f.write(json.dumps({"id": f"w{i:05d}", "messages": messages}) + "\n")
    return path
