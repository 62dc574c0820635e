"""The ``kvflow`` command: ``kvflow bench <scenario>``, ``kvflow serve``, ``kvflow pool ..``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvflow.bench import SCENARIOS
from kvflow.bench.args import check_output_path
from kvflow.bench.report import Report, machine_info, write_json
from kvflow.errors import KVFlowError
from kvflow.pool import cli as pool_cli

__all__ = ["main"]


def _parser(scenarios_needed: bool = True) -> argparse.ArgumentParser:
    """The command line; without ``scenarios_needed`` the bench scenarios (which import torch)
    are listed but not imported, so ``kvflow serve`` starts in a fraction of a second."""
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: layerwise KV pooling")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="measure kvflow against same-run references")
    scenarios = bench.add_subparsers(dest="scenario", required=True)
    for name, module_name in SCENARIOS.items():
        if not scenarios_needed:
            scenarios.add_parser(name)
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # one scenario that cannot load must not take the others
            scenarios.add_parser(name, help=f"unavailable: {exc}").set_defaults(
                module=None, error=exc
            )
            continue
        sub = scenarios.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        sub.add_argument("--quick", action="store_true", help="a smaller run, same measurement")
        sub.add_argument("--json", metavar="PATH", help="write the results as JSON")
        if hasattr(module, "plot"):
            sub.add_argument("--plot", metavar="PATH", help="draw a PNG (needs matplotlib)")
        module.add_arguments(sub)
        sub.set_defaults(module=module)
    pool_cli.add_commands(commands)
    return parser


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. A reader that goes away (``kvflow pool stats | head -1``)
    ends the command quietly, whatever the command."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit writes nowhere
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code


def _main(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parser(scenarios_needed="bench" in words[:1] or not words).parse_args(words)
    if args.command != "bench":
        return pool_cli.run(args)
    if args.module is None:
        print(f"kvflow bench {args.scenario}: {args.error}", file=sys.stderr)
        return 2
    report = Report()
    try:
        for option in ("json", "plot"):  # before the run: a bad path must not cost its results
            if getattr(args, option, None):
                check_output_path(getattr(args, option), f"--{option}")
        result = args.module.run(args, report)
    except KVFlowError as exc:  # a bad option or a failed run: say what, no traceback
        print(f"kvflow bench {args.scenario}: {exc}", file=sys.stderr)
        return 1
    result.setdefault("machine", machine_info())
    if args.json:
        report.note(f"JSON: {write_json(args.json, result)}")
    if getattr(args, "plot", None):
        args.module.plot(result, args.plot)
        report.note(f"plot: {args.plot}")
    return int(result.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
