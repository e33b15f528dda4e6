"""Stream answers with `LLM.stream`; an `on_output` callback saves each one on its own thread."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from vbatch import LLM, RequestOutput, SamplingParams

TOPICS = ["rivers", "volcanoes", "owls", "bridges", "tea", "comets", "glaciers", "violins"]


def prompts() -> Iterator[str]:
    for topic in TOPICS:
        yield f"One interesting fact about {topic}:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="HF model directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--save", type=Path, default=Path("examples/out/stream.jsonl"))
    args = parser.parse_args()
    args.save.parent.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with LLM(args.model, max_in_flight=4) as llm, args.save.open("w") as saved:

        def save(out: RequestOutput) -> None:
            record = {"index": out.index, "prompt": out.prompt, "text": out.outputs[0].text}
            saved.write(json.dumps(record) + "\n")

        for out in llm.stream(prompts(), params, on_output=save):
            print(f"[{out.index}] {out.outputs[0].text.strip()!r}")
    print(f"saved {len(TOPICS)} results to {args.save}")


if __name__ == "__main__":
    main()
