"""A recorded request log replayed: its arrivals and each request's work, and its rate per minute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def load_replay(path: Path) -> tuple[list[float], list[float], float]:
    """A recorded log: CSV rows `timestamp,prompt_tokens,output_tokens` (a header row is skipped; timestamps
    in seconds, any origin). Each request's work is its decode tokens plus an eighth of its prompt tokens
    (prefill runs batched, about that much cheaper per token), scaled so the log's mean request is 1.0."""
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0] or not parts[0].replace(".", "", 1).isdigit():
            continue
        rows.append((float(parts[0]), float(parts[1]), float(parts[2])))
    if not rows:
        raise SystemExit(f"{path}: no rows of timestamp,prompt_tokens,output_tokens")
    rows.sort()
    origin = rows[0][0]
    costs = [out + prompt / 8 for _, prompt, out in rows]
    mean = sum(costs) / len(costs) or 1.0
    times = [t - origin for t, _, _ in rows]
    return times, [c / mean for c in costs], times[-1] + 1.0


def replay_rate(times: list[float]) -> Callable[[float], float]:
    """The log's arrival rate per minute, as a step function (for the static and starting sizes)."""
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t // 60)] = counts.get(int(t // 60), 0) + 1
    return lambda t: counts.get(int(t // 60), 0) / 60.0
