"""`python -m vbatch.prepare`: the cache work of a first run (native kernels, model conversion),
done ahead, as scripts/install.sh does."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from vbatch.errors import VbatchError


def prepare(model: str | None) -> list[str]:
    """Convert `model` (None: the bundled default) into the cache and build the native kernels;
    one line per step. A failed build is reported, not raised: runs then try again on first use
    and fall back to pure-torch attention."""
    from vbatch.models.loader import cache_dir, resolve_model

    lines = [f"cache: {cache_dir()}"]
    start = time.perf_counter()
    resolved = resolve_model(model)
    lines.append(
        f"model {resolved.name}: ready in {resolved.hf_dir} ({time.perf_counter() - start:.1f} s)"
    )
    start = time.perf_counter()
    from vbatch.layers import native

    if native.is_available():
        lines.append(f"native kernels: ready ({time.perf_counter() - start:.1f} s)")
    else:
        lines.append(
            "native kernels: not built (see the warning above); the first run will try again "
            "and otherwise use pure-torch attention"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vbatch.prepare", description=__doc__)
    parser.add_argument(
        "--model", default=None, help="a GGUF file or HF directory (default: the bundled model)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        for line in prepare(args.model):
            print(line, flush=True)
    except VbatchError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
