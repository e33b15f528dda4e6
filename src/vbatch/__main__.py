"""`vbatch` and `python -m vbatch`: the command line, with the engine core spawned before the
CLI's own imports for the commands that run one core (engine/preload.py)."""

from __future__ import annotations

import sys

from vbatch.engine.preload import discard_preloaded, preload_core

PRELOADING_COMMANDS = ("run", "resume")
# NOTE: these start several cores, or none in this process, or only print.
NOT_PRELOADING_OPTIONS = ("--help", "-h", "--ray", "--replicas", "--data-parallel-size", "-dp")


def runs_one_core(args: list[str]) -> bool:
    """Whether a command line (without the program name) runs one local engine core."""
    if not args or args[0] not in PRELOADING_COMMANDS:
        return False
    return not any(arg.split("=")[0].startswith(NOT_PRELOADING_OPTIONS) for arg in args[1:])


def main() -> None:
    if runs_one_core(sys.argv[1:]):
        preload_core()
    try:
        from vbatch.cli import main as cli_main

        cli_main()
    finally:
        discard_preloaded()


if __name__ == "__main__":
    main()
