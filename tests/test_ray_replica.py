"""ReplicaEngine (a `--ray` replica's engine) driven as the driver drives it, without Ray: rows
arrive in windows that the driver refills only as finished rows come back."""

from __future__ import annotations

import time
from pathlib import Path

from vbatch.client.outputs import Request
from vbatch.engine_sets.ray_replica import ReplicaEngine
from vbatch.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def test_a_window_smaller_than_a_tokenize_batch_finishes_before_more_rows_come(
    tiny_model_dir: Path,
) -> None:
    """The driver sent 10 rows and waits for results before sending more. The inner stream used
    to block in its input, asking for a 64-row batch, while the 10 rows' outputs waited: neither
    side moved (a 600-row job on two replicas hung)."""
    engine = ReplicaEngine(str(tiny_model_dir), {"num_threads": 1})
    try:
        token, _, _ = engine.ready()
        rows = [(i, Request(prompt=f"row {i}", index=i, sampling_params=PARAMS)) for i in range(12)]
        assert engine.submit(token, 0, 0, rows[:10], is_final=False)
        finished: dict[int, object] = {}
        deadline = time.monotonic() + 60
        while len(finished) < 10:
            assert time.monotonic() < deadline, f"only {len(finished)} of 10 rows came back"
            found, _ = engine.poll(token, 0, max_wait=1.0)
            finished.update(found)
        assert engine.submit(token, 0, 1, rows[10:], is_final=True)
        while len(finished) < 12:
            assert time.monotonic() < deadline, f"only {len(finished)} of 12 rows came back"
            found, _ = engine.poll(token, 0, max_wait=1.0)
            finished.update(found)
        assert sorted(finished) == list(range(12))
        assert all(len(out.outputs[0].token_ids) == 3 for out in finished.values())
    finally:
        engine.shutdown()
