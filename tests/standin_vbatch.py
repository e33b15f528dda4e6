"""`python tests/standin_vbatch.py ARGS...`: the real `vbatch` command over a stand-in engine.

Everything but the model is real: CLI, reader, admission, writer, journal, finalize. The stand-in
answers each request at once with a text that depends only on its prompt (`expected_text`), so
a resumed job can be checked row by row. Environment knobs:

- VBATCH_STANDIN_TEXT_CHARS: length of each text (default 64);
- VBATCH_STANDIN_EXIT_AFTER=N: exit at once (os._exit, like a crash) before answering request N;
- VBATCH_STANDIN_RAISE_AFTER=N: raise RuntimeError (an unexpected bug) before answering request N;
- VBATCH_STANDIN_FAIL_START=MESSAGE: the engine fails to start with a ModelLoadError;
- VBATCH_STANDIN_EDIT_AFTER=N with VBATCH_STANDIN_EDIT_PATH: before answering request N, append
  VBATCH_STANDIN_EDIT_APPEND to that file, or cut it to VBATCH_STANDIN_EDIT_SIZE bytes (a
  producer, or a user, changing the input while the job reads it).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def expected_text(prompt: str, num_chars: int) -> str:
    """Hex digits chained from the prompt: incompressible enough that sizes are predictable."""
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    text = digest
    while len(text) < num_chars:
        digest = hashlib.sha256(digest.encode()).hexdigest()
        text += digest
    return text[:num_chars]


class StandInLLM:
    def __init__(self, model: Any, **kwargs: Any) -> None:
        from vbatch.errors import ModelLoadError
        from vbatch.protocol import Ready

        if "VBATCH_STANDIN_FAIL_START" in os.environ:
            raise ModelLoadError(os.environ["VBATCH_STANDIN_FAIL_START"])
        self.engine_info = Ready(2048, 64, 16, "cpu", "float32", 100, 0, "torch", os.getpid())
        self.latest_stats = None
        self.num_chars = int(os.environ.get("VBATCH_STANDIN_TEXT_CHARS", "64"))
        self.exit_after = int(os.environ.get("VBATCH_STANDIN_EXIT_AFTER", "-1"))
        self.raise_after = int(os.environ.get("VBATCH_STANDIN_RAISE_AFTER", "-1"))
        self.edit_after = int(os.environ.get("VBATCH_STANDIN_EDIT_AFTER", "-1"))

    def stream(
        self, inputs: Iterable[Any], sampling_params: Any = None, idle_s: float | None = None
    ) -> Iterator[Any]:
        # NOTE: every answer is immediate, so the stream is never idle for idle_s.
        from vbatch.llm import CompletionOutput, RequestOutput

        for n, req in enumerate(inputs):
            if n == self.exit_after:
                os._exit(9)
            if n == self.raise_after:
                raise RuntimeError(f"stand-in engine bug at request {n}")
            if n == self.edit_after:
                edit_input()
            prompt = req.prompt if req.prompt is not None else str(req.messages)
            text = expected_text(prompt, self.num_chars)
            now = time.time()
            yield RequestOutput(
                req.id,
                req.index,
                req.prompt,
                [1, 2, 3],
                [CompletionOutput(0, text, [7, 8], "length")],
                arrival_time=now,
                first_token_time=now,
                finish_time=now,
            )

    def engine_reports(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


def edit_input() -> None:
    path = os.environ["VBATCH_STANDIN_EDIT_PATH"]
    size = os.environ.get("VBATCH_STANDIN_EDIT_SIZE")
    if size is not None:
        os.truncate(path, int(size))
        return
    with open(path, "a") as f:
        f.write(os.environ["VBATCH_STANDIN_EDIT_APPEND"])


def main() -> None:
    import vbatch.job.execution
    from vbatch.cli import main as vbatch_main

    vbatch.job.execution.open_engine_set = StandInLLM  # type: ignore[assignment]
    sys.argv = ["vbatch", *sys.argv[1:]]
    vbatch_main()


if __name__ == "__main__":
    main()
