"""Scale-out overhead: the same rows and limits on the tiny model through one engine, `-dp 2` and
`--ray`, timed over `stream` after start-up and a warm-up.

    python -m benchmarks.scaleout [--modes single ray1 dp ray] [--num-rows 512]
        [--max-tokens 32] [--rounds 3] [--threads 1]

Each engine gets --threads threads: `single` is one LLM; `ray1` one Ray replica (the same
engine, so ray1 / single is the Ray path's own cost); `dp` one LLM with data_parallel_size=2;
`ray` 2 Ray replicas (`--replicas 2 --cpus-per-replica THREADS`, the issue's comparison with
`dp`). Ray runs on a local cluster of 2 x --threads CPUs. Prints each mode's start-up and median
stream time, the ratios, the Ray path's cost per row (its median minus the other's, over the
rows) and the driver's CPU time per row.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.workload import make_messages
from vbatch.sampling_params import SamplingParams


def _make_tiny_model(out_dir: Path) -> Path:
    from benchmarks.tiny_model import write_tiny_llama
    from vbatch.models.loader import resolve_model

    return write_tiny_llama(out_dir, resolve_model(None).hf_dir, max_position_embeddings=1024)


def _open(mode: str, model: str, args: argparse.Namespace) -> Any:
    engine_args: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if mode in ("single", "dp"):
        from vbatch.llm import LLM

        if mode == "single":
            return LLM(model, num_threads=args.threads, **engine_args)
        return LLM(model, num_threads=2 * args.threads, data_parallel_size=2, **engine_args)
    import ray

    from vbatch.engine_sets.base import RaySettings
    from vbatch.engine_sets.ray import RayEngines

    if not ray.is_initialized():
        ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=False)
    replicas = 1 if mode == "ray1" else 2
    settings = RaySettings(replicas=replicas, cpus_per_replica=args.threads)
    return RayEngines(model, settings, **engine_args)


def _time_stream(engines: Any, rows: list[Any], params: SamplingParams) -> tuple[float, float]:
    """Wall and driver CPU seconds for one stream over every row."""
    wall, cpu = time.perf_counter(), time.process_time()
    num_done = sum(out is not None for out in engines.stream(rows, params))
    assert num_done == len(rows)
    return time.perf_counter() - wall, time.process_time() - cpu


def run_mode(mode: str, model: str, rows: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engines = _open(mode, model, args)
    startup_s = time.perf_counter() - start
    try:
        _time_stream(engines, rows[: max(1, len(rows) // 8)], params)
        runs = [_time_stream(engines, rows, params) for _ in range(args.rounds)]
    finally:
        engines.shutdown()
    return {
        "startup_s": startup_s,
        "median_s": statistics.median(wall for wall, _ in runs),
        "cpu_per_row_ms": statistics.median(cpu for _, cpu in runs) / len(rows) * 1e3,
    }


def report(results: dict[str, dict[str, Any]], num_rows: int) -> None:
    print(f"{'mode':8} {'start-up s':>10} {'median s':>9} {'rows/s':>8} {'driver CPU ms/row':>18}")
    for mode, r in results.items():
        print(
            f"{mode:8} {r['startup_s']:10.1f} {r['median_s']:9.2f} "
            f"{num_rows / r['median_s']:8.1f} {r['cpu_per_row_ms']:18.3f}"
        )
    for ray_mode, other in (("ray1", "single"), ("ray", "dp"), ("ray", "single")):
        if ray_mode in results and other in results:
            ray_s, other_s = results[ray_mode]["median_s"], results[other]["median_s"]
            print(
                f"{ray_mode} / {other}: {ray_s / other_s:.3f}x; Ray path cost "
                f"{(ray_s - other_s) / num_rows * 1e3:+.3f} ms per row"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["single", "ray1", "dp", "ray"])
    parser.add_argument("--num-rows", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="model directory (default: a tiny random Llama)")
    args = parser.parse_args(argv)
    rows = make_messages(args.num_rows)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(_make_tiny_model(Path(tmp)))
        for mode in args.modes:
            results[mode] = _guard(mode, lambda m=mode: run_mode(m, model, rows, args))
    report({m: r for m, r in results.items() if r}, args.num_rows)


def _guard(mode: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A mode that cannot run here (e.g. `dp` before data_parallel_size exists) is reported and
    skipped, so the other modes still print."""
    try:
        return run()
    except Exception as e:
        print(f"{mode}: could not run ({type(e).__name__}: {e})")
        return {}


if __name__ == "__main__":
    main()
