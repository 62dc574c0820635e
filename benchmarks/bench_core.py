"""Core targets: ``kvflow bench copy|addrgen|metadata``, then PASS/FAIL per target.

python benchmarks/bench_core.py [--quick] [--strict]     (JSON in bench-results/)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvflow.cli import main as kvflow

OUT = Path(__file__).resolve().parent.parent / "bench-results"


def scenario(name: str, quick: bool) -> dict[str, Any]:
    path = OUT / f"{name}.json"
    kvflow(["bench", name, "--json", str(path), *(["--quick"] if quick else [])])
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the scenarios' quick runs")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    copy, addrgen, meta = (scenario(n, args.quick) for n in ("copy", "addrgen", "metadata"))

    def copy_ratio(block: int) -> float:  # coalesced, 1 thread, native loop; worst row
        rows = [r for r in copy["rows"] if r["block_bytes"] == block and r["coalesced"]]
        rows = [r for r in rows if r["threads"] == 1 and r.get("loop") == "native"]
        return min((r["ratio_to_memcpy"] for r in rows), default=0.0)

    c128, c4 = copy_ratio(128 << 10), copy_ratio(4 << 10)
    at512 = [r for r in addrgen["rows"] if r["blocks"] == 512]
    speedup = min((r["speedup"] for r in at512), default=0.0)
    share = max((r["share_of_copy_time"] for r in at512), default=1.0)
    calls = sorted({r["kvflow_calls_per_request"] for r in meta["rows"]})
    factors = sorted({r["layer_factor"] / r["layers"] for r in meta["rows"]})
    checks = [
        (c128 >= 0.85, f"batch_copy at 128 KiB, coalesced: {c128:.0%} of memcpy (>= 85%)"),
        (c4 >= 0.50, f"batch_copy at 4 KiB, coalesced: {c4:.0%} of memcpy (>= 50%)"),
        (speedup >= 20, f"addrgen at 512 blocks: {speedup:.0f}x the Python reference (>= 20x)"),
        (share < 0.02, f"addrgen at 512 blocks: {share:.2%} of the layer's copy time (< 2%)"),
        (len(calls) == 1, f"kvflow metadata calls per request over layer counts: {calls}"),
        (
            factors == [1.0],
            "keys per request: per chunk, `layers` times fewer than per (layer, block)",
        ),
    ]
    print("\nSummary against targets")
    for ok, text in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    passed = all(ok for ok, _ in checks)
    print(f"  overall: {'PASS' if passed else 'FAIL'}")
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    sys.exit(main())
