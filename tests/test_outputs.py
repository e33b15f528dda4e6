"""Tests for client/outputs.py: vLLM's output shapes survive pickling (Ray replicas send them)."""

from __future__ import annotations

import pickle
import queue

from vbatch.client.outputs import CompletionOutput
from vbatch.protocol import TokenLogprobs


class _Client:
    """Stands for the LLM whose bound method decodes tokens: it holds a queue, as LLM does."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[int] = queue.SimpleQueue()

    def decode(self, token_id: int) -> str:
        return f"<{token_id}>"


def test_a_pickled_output_carries_its_logprobs_decoded_and_not_its_decoder() -> None:
    entry = TokenLogprobs(-0.5, [7, 3], [-0.5, -1.5], rank=1)
    out = CompletionOutput(0, "x", [7], "length", token_logprobs=[entry])
    out.decode_token = _Client().decode
    copy = pickle.loads(pickle.dumps(out))
    assert copy.decode_token is None
    assert copy.logprobs == out.logprobs
    assert copy.logprobs[0][3].decoded_token == "<3>"
    assert copy.cumulative_logprob == -0.5
