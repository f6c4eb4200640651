"""The simulator's verdict on the goodput law (bench/autoscale_sim.py): it meets the SLO with fewer
replica-seconds than static peak provisioning, and beats the queue-length HPA (bench/README.md).

One hour per trace on the measured capacity curve, a 60 s pod start-up, seeded Poisson
arrivals; the same run `python -m bench.autoscale_sim` prints. Also: the replay format, and
that the --grid figures (the law without a capacity hint against the concurrency HPA) are the
runs it reports and the table bench/README.md shows.
"""

import json
from pathlib import Path

import pytest

from bench.autoscale_grid import grid, grid_table, parse_seeds, targets
from bench.autoscale_model import (
    BURST_EVERY,
    BURST_SPAN,
    Curve,
    arrivals,
    size_sampler,
    traces,
    write_trace,
)
from bench.autoscale_replay import load_replay, replay_rate
from bench.autoscale_run import POISSON_LAW, POLICIES, YARDSTICKS, run, simulate, trace_run
from bench.autoscale_surface import static_attainment
from goodput_operator.autoscaling.dispersion import DISPERSION_PERIODS, index_of_dispersion

ROOT = Path(__file__).resolve().parents[2]

TARGET = 0.95


@pytest.fixture(scope="module")
def results():
    return simulate(duration=3600.0, startup=60.0, seed=7, target=TARGET, names=("steady", "ramp", "spike", "diurnal"))


@pytest.mark.parametrize("trace", ["steady", "ramp", "spike", "diurnal"])
def test_goodput_law_meets_the_slo_with_fewer_replicas_than_static_peak(results, trace):
    ours, static = results[trace]["goodput"], results[trace]["static-peak"]
    assert ours["attainment"] >= TARGET, ours["attainment"]
    assert ours["replica_seconds"] < static["replica_seconds"]


@pytest.mark.parametrize("trace", ["steady", "ramp", "spike", "diurnal"])
def test_goodput_law_beats_the_queue_length_law(results, trace):
    ours, queue = results[trace]["goodput"], results[trace]["queue-hpa"]
    assert ours["attainment"] > queue["attainment"]
    assert ours["replica_seconds"] <= 1.10 * queue["replica_seconds"]


def test_with_the_runtimes_admission_the_law_holds_and_a_queue_length_hpa_goes_blind():
    curve = Curve.load()
    runs = {
        (name, policy, admission): trace_run(curve, name, 3600.0, policy, 60.0, 7, TARGET, admission=admission)
        for name in ("steady", "flash")
        for policy in ("goodput", "queue-hpa")
        for admission in (False, True)
    }
    # within capacity the law's replicas refuse nothing: admission changes no request
    steady = runs["steady", "goodput", True]
    assert steady["refused"] == 0 and steady["attainment"] == runs["steady", "goodput", False]["attainment"]
    # on the flash crowd, past capacity until new replicas are up, admission refuses, and the law (which reads
    # refusals as demand) meets the SLO on at least as many requests with no more replica-seconds
    flash, flash_off = runs["flash", "goodput", True], runs["flash", "goodput", False]
    assert flash["refused"] > 0
    assert flash["attainment"] >= flash_off["attainment"]
    assert flash["replica_seconds"] <= flash_off["replica_seconds"]
    # admission keeps queues short, so an HPA on queue length sees none, never scales, and refuses most requests
    for name in ("steady", "flash"):
        blind, before = runs[name, "queue-hpa", True], runs[name, "queue-hpa", False]
        assert blind["attainment"] < 0.5 < before["attainment"], (name, blind["attainment"], before["attainment"])
        assert blind["refused"] > blind["requests"] / 2


def test_replay_reads_timestamp_prompt_and_output_tokens(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("timestamp,prompt_tokens,output_tokens\n1000.5, 800, 100\n1000.0,80,10\n\n1002.0,0,290\n")
    times, works, duration = load_replay(log)
    assert times == [0.0, 0.5, 2.0]  # sorted, from the first request
    costs = [10 + 80 / 8, 100 + 800 / 8, 290]  # decode tokens plus an eighth of the prompt's
    mean = sum(costs) / 3
    assert works == pytest.approx([c / mean for c in costs])  # the log's mean request is 1.0
    assert duration == 3.0
    empty = tmp_path / "empty.csv"
    empty.write_text("timestamp,prompt_tokens,output_tokens\n")
    with pytest.raises(SystemExit):
        load_replay(empty)


def test_a_replayed_log_runs_through_every_policy_and_both_yardsticks(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("\n".join(f"{i * 2.0},{100 + i % 7 * 50},{20 + i % 5 * 40}" for i in range(300)))
    times, works, duration = load_replay(log)
    curve = Curve.load()
    for policy in (*POLICIES, POISSON_LAW, *YARDSTICKS):
        r = run(curve, replay_rate(times), duration, policy, 60.0, 7, 1, 20, TARGET, 8, replay=(times, works))
        assert r["requests"] == 300 and 0.0 <= r["attainment"] <= 1.0 and r["replica_seconds"] > 0


def test_grid_figures_are_the_runs_it_reports():
    """grid() reports, per trace and start-up, the worst and mean attainment and the replica-seconds ratio
    of the same runs `run` gives; the table prints exactly those figures."""
    rows = grid([1, 2], [60.0], duration=600.0, names=("steady", "burst"))
    curve = Curve.load()
    for row in rows:
        ours, hpa = [], []
        for seed in (1, 2):
            ours.append(trace_run(curve, row["trace"], 600.0, "goodput-no-hint", 60.0, seed))
            hpa.append(trace_run(curve, row["trace"], 600.0, "concurrency-hpa", 60.0, seed))
        assert row["goodput_attainment_min"] == min(r["attainment"] for r in ours)
        assert row["hpa_attainment_mean"] == pytest.approx(sum(r["attainment"] for r in hpa) / 2)
        ratios = [g["replica_seconds"] / h["replica_seconds"] for g, h in zip(ours, hpa, strict=True)]
        assert row["replica_s_ratio_max"] == pytest.approx(max(ratios))
    table = grid_table(rows)
    for row in rows:
        assert (
            f"| {row['trace']} | 60 s | {row['goodput_attainment_min']:.3f} / {row['goodput_attainment_mean']:.3f} |"
        ) in table


def test_the_documented_grid_is_the_one_the_bench_wrote():
    """bench/README.md shows `python -m bench.autoscale_sim --grid`'s table for the JSON it wrote."""
    rows = json.loads((ROOT / "bench" / "results" / "autoscale-grid.json").read_text())
    assert grid_table(rows) in (ROOT / "bench" / "README.md").read_text()


def test_the_surface_shows_pooling_and_the_cost_of_load():
    """--surface: static replicas at a steady load per replica. More load costs attainment; at the same load
    per replica, more replicas behind least-loaded routing meet the SLO more often (the square-root headroom)."""
    curve = Curve.load()
    light, heavy = (static_attainment(curve, 4, x, seed=1, duration=1200.0) for x in (0.7, 1.1))
    assert light > heavy
    few, many = (static_attainment(curve, n, 0.9, seed=1, duration=1200.0) for n in (2, 12))
    assert many > few


def test_grid_seeds_read_as_ranges_or_lists():
    assert parse_seeds("1-5") == [1, 2, 3, 4, 5]
    assert parse_seeds("3,8") == [3, 8]


def test_the_yardsticks_bound_what_seeing_only_the_present_can_do():
    """The grid's two bounds, on the flash crowd with a 180 s start-up: knowing the future rate and the exact
    capacity meets the SLO; knowing the exact rate only as it comes, and the exact capacity, cannot (the
    crowd outruns every pod asked for at its first sign), and neither can the law, which knows neither."""
    curve = Curve.load()
    base = curve.capacity_point(TARGET)[0]
    trace = traces(base, 3600.0, 1)["flash"]
    seer, now, law, hpa = (
        run(curve, trace, 3600.0, p, 180.0, 1, 1, 20, TARGET, 8)
        for p in ("clairvoyant", "reactive-bound", "goodput-no-hint", "concurrency-hpa")
    )
    assert seer["attainment"] >= TARGET
    assert now["attainment"] < 0.85 and law["attainment"] < 0.85 and hpa["attainment"] < 0.85
    assert seer["replica_seconds"] < hpa["replica_seconds"]  # the future, known, costs less, not more
    # steady load: nothing to foresee, so the two bounds are the same policy
    steady = traces(base, 3600.0, 1)["steady"]
    a, b = (run(curve, steady, 3600.0, p, 60.0, 1, 1, 20, TARGET, 8) for p in ("clairvoyant", "reactive-bound"))
    assert a["replica_seconds"] == b["replica_seconds"] and a["attainment"] >= TARGET


def counts(times: list[float], period: float = 15.0) -> list[tuple[float, float]]:
    out = [0.0] * int(3600 // period)
    for t in times:
        out[int(t // period)] += 1
    return [(period, c) for c in out]


def mean_index(times: list[float]) -> float:
    series = counts(times)
    readings = [
        index_of_dispersion(series[i : i + DISPERSION_PERIODS])
        for i in range(0, len(series) - DISPERSION_PERIODS, DISPERSION_PERIODS // 4)
    ]
    return sum(r.index for r in readings if r) / len(readings)


def test_the_burst_traces_are_over_dispersed_at_the_control_periods_scale_and_the_others_are_not():
    """The burst traces (a Poisson background and bursts of 5-30 s about once a minute): counts per 15 s swing
    about four times as far as Poisson's, as bench/README.md states; the Poisson traces read 1."""
    base = Curve.load().capacity_point(TARGET)[0]
    for seed in (1, 2):
        burst = mean_index(arrivals(traces(base, 3600.0, seed)["burst"], 3600.0, seed))
        assert 3.0 < burst < 5.5, burst
        steady = mean_index(arrivals(traces(base, 3600.0, seed)["steady"], 3600.0, seed))
        assert 0.85 < steady < 1.15, steady
    assert BURST_SPAN == (5.0, 30.0) and BURST_EVERY == 60.0


def test_the_heavy_tailed_mix_is_heavy_tailed_with_a_mean_of_one():
    draw = size_sampler("lognormal", 3)
    works = [draw() for _ in range(100_000)]
    mean = sum(works) / len(works)
    cv2 = sum((w - mean) ** 2 for w in works) / len(works) / mean**2
    assert mean == pytest.approx(1.0, abs=0.03)
    assert 1.0 < cv2 < 1.6  # squared coefficient of variation (±50 % uniform: 0.08)
    assert max(works) > 10  # a request ten times the mean work is not rare


def test_a_written_trace_replays_as_the_same_requests(tmp_path):
    """--write-trace writes a trace in the replay format, so any policy can run on exactly those requests."""
    path = tmp_path / "burst.csv"
    rows = write_trace("burst-heavy", path, duration=600.0, seed=3)
    times, works, _ = load_replay(path)
    base = Curve.load().capacity_point(TARGET)[0]
    assert len(times) == rows == len(arrivals(traces(base, 600.0, 3)["burst-heavy"], 600.0, 3))
    assert sum(works) / len(works) == pytest.approx(1.0) and max(works) > 5


def test_the_targets_are_read_off_the_rows():
    row = {
        "trace": "burst",
        "startup_s": 60.0,
        "goodput_attainment_mean": 0.94,
        "hpa_attainment_mean": 0.93,
        "replica_s_ratio_mean": 0.9,
        "reactive_bound_attainment_mean": 0.96,
        "clairvoyant_replica_s_ratio_mean": 0.88,
    }
    t = targets([row])
    assert list(t["misses"]) == ["burst 60 s"]  # attainment under the reactive bound's − 0.01
    assert t["over_clairvoyant"] == pytest.approx(0.9 / 0.88 - 1)
    assert targets([{**row, "goodput_attainment_mean": 0.951}])["misses"] == {}


def test_the_yardsticks_limits_are_kept_on_disk_and_computed_again_for_other_arguments(tmp_path, monkeypatch):
    """load_limits (half a minute of bisection) is computed once per argument set, curve and simulator source:
    a second process reads the same figures from disk, and other arguments compute their own."""
    from bench import autoscale_surface

    computed: list[tuple] = []

    def bisect(target, max_num_seqs, sizes):
        computed.append((target, max_num_seqs, sizes))
        return ((1, 0.5 + target / 10), (2, 0.625))

    monkeypatch.setattr(autoscale_surface, "LIMITS_CACHE", tmp_path)
    monkeypatch.setattr(autoscale_surface, "_bisect_limits", bisect)
    autoscale_surface.load_limits.cache_clear()
    try:
        first = autoscale_surface.load_limits(0.9)
        autoscale_surface.load_limits.cache_clear()  # as a new process would start
        assert autoscale_surface.load_limits(0.9) == first == ((1, 0.59), (2, 0.625))
        assert computed == [(0.9, 8, "uniform")] and len(list(tmp_path.glob("*.json"))) == 1
        autoscale_surface.load_limits(0.95, sizes=(1.0, 2.0))
        assert computed[-1] == (0.95, 8, (1.0, 2.0)) and len(list(tmp_path.glob("*.json"))) == 2
    finally:
        autoscale_surface.load_limits.cache_clear()
