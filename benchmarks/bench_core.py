"""Core targets: ``kvflow bench copy|addrgen|metadata``, then PASS/FAIL per target.

python benchmarks/bench_core.py [--quick] [--strict]     (JSON in bench-results/)

Exits with a scenario's own exit code when one is not 0 (the first such), else 1 with
``--strict`` when a target fails, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvflow.bench.args import fmt_bytes
from kvflow.cli import main as kvflow

OUT = Path(__file__).resolve().parent.parent / "bench-results"
COPY_TARGET_FROM = 64 << 10  # batch_copy >= 85 % of memcpy at every block size from here up


def scenario(name: str, quick: bool) -> tuple[int, dict[str, Any]]:
    """Run ``kvflow bench name``; its exit code and its JSON (never a previous run's)."""
    path = OUT / f"{name}.json"
    path.unlink(missing_ok=True)
    code = kvflow(["bench", name, "--json", str(path), *(["--quick"] if quick else [])])
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"rows": []}
    return code, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the scenarios' quick runs")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    names = ("copy", "addrgen", "metadata")
    codes, (copy, addrgen, meta) = zip(*(scenario(n, args.quick) for n in names), strict=True)

    def copy_ratio(blocks: set[int]) -> tuple[float, int]:
        """The worst ratio to memcpy, and its block size, of the native loop on 1 thread with
        block ids in order, over ``blocks`` (both directions, pinned or not); 0.0 without
        such a row."""
        rows = [r for r in copy["rows"] if r["block_bytes"] in blocks and r["coalesced"]]
        rows = [r for r in rows if r["threads"] == 1 and r.get("loop") == "native"]
        worst = min(rows, key=lambda r: r["ratio_to_memcpy"], default=None)
        return (0.0, 0) if worst is None else (worst["ratio_to_memcpy"], worst["block_bytes"])

    large = {r["block_bytes"] for r in copy["rows"] if r["block_bytes"] >= COPY_TARGET_FROM}
    c_large, at = copy_ratio(large)
    c4, _ = copy_ratio({4 << 10})
    at512 = [r for r in addrgen["rows"] if r["blocks"] == 512]
    speedup = min((r["speedup"] for r in at512), default=0.0)
    share = max((r["share_of_copy_time"] for r in at512), default=1.0)
    calls = sorted({r["kvflow_calls_per_request"] for r in meta["rows"]})
    factors = sorted({r["layer_factor"] / r["layers"] for r in meta["rows"]})
    checks = [
        *(
            (code == 0, f"kvflow bench {name}: exit code {code}")
            for name, code in zip(names, codes, strict=True)
        ),
        (
            c_large >= 0.85,
            f"batch_copy at every block size >= {fmt_bytes(COPY_TARGET_FROM)} "
            f"({', '.join(fmt_bytes(b) for b in sorted(large)) or 'none measured'}), coalesced: "
            f"worst {c_large:.0%} of memcpy" + (f" at {fmt_bytes(at)}" if at else "") + " (>= 85%)",
        ),
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
    failed = next((code for code in codes if code != 0), 0)
    if failed:
        return failed
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    sys.exit(main())
