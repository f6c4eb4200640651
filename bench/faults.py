"""The fault table: runs the `faults` tests and collects what each saw.

    python -m bench.faults                       # every tier: apiserver, runtime, e2e (needs root; the node)
    python -m bench.faults --tiers apiserver,runtime
    python -m bench.faults --e2e-lock /tmp/goodput-e2e.lock   # the e2e tier waits for a shared node

Each fault is a test marked `faults` that injects it for real and asserts what a user sees
(tests/operator/test_faults_control_plane.py, tests/runtime/test_kv_pressure.py,
tests/e2e/test_faults.py; docs/reliability.md). Each prints one `FAULT-ROW {json}` line:
the fault, the requests a client sent through it (API writes for the control-plane faults,
completions for the others), how many failed and how many were retried, and the seconds
from the fault's end to convergence. This script runs them with pytest, writes the rows to
bench/results/faults.json and prints the table. A failing test fails the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = {
    "apiserver": "tests/operator/test_faults_control_plane.py",
    "runtime": "tests/runtime/test_kv_pressure.py",
    "e2e": "tests/e2e/test_faults.py",
}
COLUMNS = (
    ("fault", "fault"),
    ("tier", "tier"),
    ("requests", "requests sent"),
    ("failed", "failed"),
    ("retried", "retried"),
    ("converge_s", "converge (s)"),
)


def run_tier(path: str, lock: Path | None) -> tuple[list[dict], int, float]:
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "pytest", path, "-m", "faults", "-s", "-q", "-p", "no:cacheprovider"]
    if lock is not None:
        command = ["flock", str(lock), *command]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    # pytest's progress dots may share the line
    rows = [json.loads(line.split("FAULT-ROW ", 1)[1]) for line in result.stdout.splitlines() if "FAULT-ROW " in line]
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-3000:], sep="\n", file=sys.stderr)
    return rows, result.returncode, time.monotonic() - started


def table(rows: list[dict]) -> str:
    cells = [[str(row.get(key, "")) for key, _ in COLUMNS] for row in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (_, title) in enumerate(COLUMNS)]
    lines = [
        "| " + " | ".join(title.ljust(w) for (_, title), w in zip(COLUMNS, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, of {', '.join(TIERS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    parser.add_argument(
        "--e2e-lock",
        type=Path,
        default=None,
        help="a file to hold with flock(1) while the e2e tier runs, where the node is shared",
    )
    args = parser.parse_args(argv)
    rows: list[dict] = []
    runs = {}
    for tier in args.tiers.split(","):
        tier_rows, code, seconds = run_tier(TIERS[tier], args.e2e_lock if tier == "e2e" else None)
        rows += tier_rows
        runs[tier] = {"exit_code": code, "seconds": round(seconds, 1), "faults": len(tier_rows)}
        print(f"{tier}: {len(tier_rows)} faults, pytest exit {code}, {seconds:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs, "rows": rows}, indent=1)
        + "\n"
    )
    print(table(rows))
    print(f"written to {args.out}")
    return 0 if all(r["exit_code"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
