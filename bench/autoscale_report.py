"""The simulator's per-trace table and plots (bench/autoscale_sim.py without --grid)."""

from __future__ import annotations

from pathlib import Path


def table(results: dict[str, dict[str, dict]]) -> str:
    """Attainment and replica-seconds per trace and policy; with admission (any request refused), the 429s."""
    refusals = any(r.get("refused") for by_policy in results.values() for r in by_policy.values())
    head = f"{'trace':<8} {'policy':<16} {'attainment':>10} {'replica-s':>9} {'/static':>7} {'/queue':>7} {'/conc':>7}"
    lines = [head + (f" {'429s':>6}" if refusals else ""), "-" * (77 if refusals else 70)]
    for name, by_policy in results.items():
        for policy, r in by_policy.items():
            rs = r["replica_seconds"]
            ratios = [rs / by_policy[p]["replica_seconds"] for p in ("static-peak", "queue-hpa", "concurrency-hpa")]
            line = f"{name:<8} {policy:<16} {r['attainment']:>10.3f} {rs:>9.0f} " + " ".join(
                f"{x:>7.2f}" for x in ratios
            )
            lines.append(line + (f" {r.get('refused', 0):>6}" if refusals else ""))
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], out: Path) -> list[Path]:
    import matplotlib  # optional: only for --plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, by_policy in results.items():
        fig, (ax_load, ax_rep, ax_att) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        first = next(iter(by_policy.values()))["timeline"]
        ax_load.plot([p[0] for p in first], [p[1] for p in first], color="black")
        ax_load.set_ylabel("arrivals (req/s)")
        for policy, r in by_policy.items():
            t = [p[0] for p in r["timeline"]]
            ax_rep.step(t, [p[2] for p in r["timeline"]], where="post", label=policy)
            ax_att.plot(t, [p[4] if p[4] is not None else float("nan") for p in r["timeline"]], label=policy)
        ax_rep.set_ylabel("replicas")
        ax_rep.legend()
        ax_att.set_ylabel("attainment (1 min)")
        ax_att.set_xlabel("seconds")
        ax_att.set_ylim(0, 1.02)
        fig.suptitle(f"trace: {name}")
        path = out / f"autoscale-{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
