"""bench.slo_capacity: the capacity rule (non-monotone ladders included), the rung chosen for goodput beyond
capacity, the trace and the built-in length mix, attainment with refusals, and one short run of two of
our servers (``--peer ours``) on the tiny model. vLLM is not needed: its client check is exercised only
where its venv exists, by hand."""

from __future__ import annotations

import argparse
import json
import signal
import statistics
from pathlib import Path

import pytest

from bench import slo_capacity as sc
from bench import slo_judge as sj
from bench import slo_report as sr
from bench.stats import RequestRecord


def test_capacity_is_the_rung_below_the_first_failure():
    ladder = {1.0: 1.0, 1.5: 0.97, 2.0: 0.9, 2.5: 0.6, 3.0: 0.2}
    cap = sj.capacity(ladder)
    assert cap["rps"] == 2.0  # exactly 0.9 passes
    assert cap["first_failing_rps"] == 2.5
    assert not cap["non_monotone"] and not cap["below_ladder"] and not cap["top_of_ladder"]


def test_a_ladder_passing_again_above_a_failure_is_flagged_but_keeps_the_lower_capacity():
    ladder = {1.0: 0.99, 2.0: 0.85, 3.0: 0.95, 4.0: 0.5, 5.0: 0.92}
    cap = sj.capacity(ladder)
    assert cap["rps"] == 1.0
    assert cap["non_monotone"] and cap["passing_above_first_failure"] == [3.0, 5.0]
    assert cap["highest_passing_rps"] == 5.0


def test_capacity_below_and_at_the_top_of_the_ladder_and_unjudged_rungs():
    below = sj.capacity({1.0: 0.5, 2.0: 0.95})
    assert below["rps"] is None and below["below_ladder"] and below["non_monotone"]
    top = sj.capacity({1.0: 1.0, 2.0: 0.95})
    assert top["rps"] == 2.0 and top["top_of_ladder"]
    # a rung where no request arrived is not judged either way
    assert sj.capacity({0.5: None, 1.0: 0.95, 2.0: 0.4})["rps"] == 1.0
    assert sj.capacity({1.0: 0.8}, threshold=0.75)["rps"] == 1.0
    assert sj.ratio(2.0, 1.0) == 2.0 and sj.ratio(None, 1.0) is None and sj.ratio(1.0, None) is None


def rung(goodput: float, attainment: float) -> dict:
    return {"goodput_rps": goodput, "attainment": attainment, "per_seed": {"goodput_rps": [goodput, goodput]}}


def test_goodput_beyond_capacity_comes_from_the_rung_at_or_nearest_the_multiple():
    rates = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0]
    rungs = {r: rung(10 * r, 1 / r) for r in rates}
    at_2 = sj.beyond_capacity(2.0, rungs)
    assert at_2["1.5x"]["rung_rps"] == 3.0 and at_2["1.5x"]["exact"] and at_2["1.5x"]["goodput_rps"] == 30.0
    assert at_2["2x"]["rung_rps"] == 4.0 and at_2["2x"]["exact"]
    assert at_2["2x"]["goodput_per_seed"] == [40.0, 40.0]
    at_1_5 = sj.beyond_capacity(1.5, rungs)
    assert at_1_5["1.5x"]["target_rps"] == 2.25 and at_1_5["1.5x"]["rung_rps"] == 2.5  # a tie: the higher rung
    assert not at_1_5["1.5x"]["exact"]
    assert at_1_5["2x"]["rung_rps"] == 3.0
    at_4 = sj.beyond_capacity(4.0, rungs)  # beyond the ladder: its top rung, not exact
    assert at_4["1.5x"]["rung_rps"] == 5.0 and at_4["2x"]["rung_rps"] == 5.0 and not at_4["2x"]["exact"]
    assert sj.beyond_capacity(None, rungs) == {"1.5x": None, "2x": None}
    assert sj.nearest_rung([1.0, 2.0, 4.0], 2.9) == 2.0


def test_a_csv_trace_is_scaled_rounded_and_capped(tmp_path: Path):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,prompt_tokens,output_tokens\n0.0,1000,200\n0.5,2,1\n1.0,9000,3000\n1.2,402,6\n")
    assert sj.load_trace(trace, 0.25, 1000, 256) == [(250, 50), (1, 1), (1000, 256), (100, 2)]
    assert sj.load_trace(trace, 1.0, 5000, 5000)[2] == (5000, 3000)
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    assert sj.load_trace(azure, 0.5, 1000, 256) == [(187, 22)]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,in,out\n0,1,2\n")
    with pytest.raises(ValueError, match="want a header"):
        sj.load_trace(bad, 0.25, 1000, 256)
    worse = tmp_path / "worse.csv"
    worse.write_text("timestamp,prompt_tokens,output_tokens\n0,many,2\n")
    with pytest.raises(ValueError, match=r"worse\.csv:2"):
        sj.load_trace(worse, 0.25, 1000, 256)


def test_the_built_in_mix_has_the_stated_medians_and_bounds():
    lengths = sj.builtin_lengths(4000, seed=3, max_prompt=1000, max_output=256)
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    assert 225 <= statistics.median(prompts) <= 275  # median 250
    assert 54 <= statistics.median(outputs) <= 66  # median 60
    assert 320 <= statistics.fmean(prompts) <= 380 and 68 <= statistics.fmean(outputs) <= 82
    assert min(prompts) >= 16 and max(prompts) == 1000 and min(outputs) >= 8 and max(outputs) == 256
    assert sj.builtin_lengths(50, 3, 1000, 256) == lengths[:50]  # seeded
    assert max(p for p, _ in sj.builtin_lengths(500, 3, 300, 40)) == 300  # the caps apply to the mix too


def test_a_rung_is_seeded_open_loop_and_the_same_for_every_server():
    vocabulary = list(range(100, 200))
    a = sj.rung_items(2.0, 0, 30.0, vocabulary, None, 1000, 256)
    assert a == sj.rung_items(2.0, 0, 30.0, vocabulary, None, 1000, 256)
    assert a != sj.rung_items(2.0, 1, 30.0, vocabulary, None, 1000, 256)
    assert 30 <= len(a) <= 95  # Poisson, mean 60
    assert all(0 <= i.arrival_s < 30.0 for i in a)
    assert [i.arrival_s for i in a] == sorted(i.arrival_s for i in a)
    assert len({tuple(i.prompt_ids[:8]) for i in a}) == len(a)  # random tokens: no shared prefixes
    traced = sj.rung_items(4.0, 0, 10.0, vocabulary, [(7, 3)], 1000, 256)
    assert {(len(i.prompt_ids), i.max_tokens) for i in traced} == {(7, 3)}


def record(index: int, ttft: float | None, e2e: float | None, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(index, 10, tokens, float(index), ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, error=error)


def test_attainment_counts_refusals_and_failures_as_not_met():
    slo = sj.Slo(1.0, 0.1)
    records = [
        record(0, 0.2, 2.0, 20),  # TPOT 0.095: met
        record(1, 0.2, 4.0, 20),  # TPOT 0.2: missed
        record(2, 1.5, 2.0, 5),  # TTFT missed
        record(3, 0.1, 0.1, 1),  # one token: TPOT undefined, counts as met
        record(4, None, None, 0, error='HTTP 429: {"error": "over capacity"}'),
        record(5, None, None, 0, error="cut off by --max-duration"),
    ]
    verdict = sj.judge(records, 10.0, slo)
    assert verdict["sent"] == 6 and verdict["met"] == 2
    assert verdict["attainment"] == pytest.approx(2 / 6)
    assert verdict["goodput_rps"] == pytest.approx(0.2)  # per second of window
    assert verdict["refused"] == 1 and verdict["failed"] == 1
    assert verdict["output_tok_s"] == pytest.approx(4.6) and verdict["offered_rps"] == pytest.approx(0.6)
    assert verdict["tpot_p50_s"] is not None and verdict["ttft_p90_s"] is not None
    assert sj.judge([], 10.0, slo)["attainment"] is None
    runs = [{**verdict, "seed": 0}, {**verdict, "attainment": 1.0, "sent": 4, "seed": 1}]
    mean = sj.aggregate(runs)
    assert mean["attainment"] == pytest.approx((2 / 6 + 1.0) / 2)
    assert mean["per_seed"]["attainment"] == [pytest.approx(2 / 6), 1.0] and mean["sent_total"] == 10


def test_admission_s_predictions_are_held_against_the_measurement():
    slo = sj.Slo(1.0, 0.1)
    a, b = record(0, 0.2, 2.0, 20), record(1, 0.6, 2.5, 20)  # TPOT 0.095 and 0.1
    a.predicted_ttft_s, a.predicted_tpot_s = 0.1, 0.05
    b.predicted_ttft_s = 0.3
    verdict = sj.judge([a, b, record(2, 0.2, 2.0, 20)], 10.0, slo)  # the third carried no prediction
    assert verdict["ttft_pred_mae_s"] == pytest.approx((0.1 + 0.3) / 2)
    assert verdict["ttft_measured_over_predicted"] == pytest.approx((2.0 + 2.0) / 2)
    assert verdict["tpot_pred_mae_s"] == pytest.approx(1.8 / 19 - 0.05)
    assert verdict["tpot_measured_over_predicted"] == pytest.approx(1.8 / 19 / 0.05)
    assert sj.judge([record(0, 0.2, 2.0, 20)], 10.0, slo)["ttft_pred_mae_s"] is None


def test_slo_pairs_and_drain():
    assert sj.parse_slo("2:0.1") == sj.Slo(2.0, 0.1)
    assert sj.parse_slo("500ms:200ms") == sj.Slo(0.5, 0.2)
    assert sj.Slo(0.5, 0.2).label == "TTFT <= 500 ms, TPOT <= 200 ms"
    for bad in ("2", "0:0.1", "x:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            sj.parse_slo(bad)
    assert sj.drain_s(sj.Slo(2.0, 0.1), 256) == pytest.approx(28.5)
    assert sj.parse_rates("2,1,1.5,2") == [1.0, 1.5, 2.0]


@pytest.mark.slow
def test_a_short_run_of_two_of_our_servers_writes_every_field(tiny_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "slo.json"
    handler = signal.getsignal(signal.SIGTERM)
    try:
        sc.main(
            [
                *("--quick", "--model", str(tiny_model_dir), "--peer", "ours", "--window", "3"),
                *("--rates", "2,4", "--slo", "2:0.1", "--output", str(out), "--log-dir", str(tmp_path / "logs")),
            ]
        )
    finally:
        signal.signal(signal.SIGTERM, handler)
    report = json.loads(out.read_text())
    for key in ("kind", "config", "model", "peer", "server_args", "workload", "machine", "startup_s", "slo_pairs"):
        assert key in report, key
    assert report["peer"] == "ours-peer" and report["config"]["rate_list"] == [2.0, 4.0]
    assert "--slo-ttft" in report["server_args"]["ours"] and "--dtype" in report["server_args"]["ours"]
    [pair] = report["slo_pairs"]
    assert pair["slo"] == {"ttft_s": 2.0, "tpot_s": 0.1} and pair["drain_s"] > 3
    for name in ("ours", "ours-peer"):
        for rate in ("2.0", "4.0"):
            r = pair["rungs"][name][rate]
            for key in (*sj.METRICS, "per_seed", "seeds", "sent_total", "met_total", "refused_total", "failed_total"):
                assert key in r, (name, rate, key)
            assert r["sent_total"] > 0 and r["attainment"] is not None
            assert r["failed_total"] == 0, r
            assert len(r["per_seed"]["goodput_rps"]) == 1
        cap = pair["capacity"][name]
        assert {"rps", "highest_passing_rps", "non_monotone", "below_ladder", "top_of_ladder"} <= set(cap)
        assert set(pair["beyond_capacity"][name]) == {"1.5x", "2x"}
    assert "ratio" in pair["capacity"]
    # our runtime's responses carry admission's predictions once it has timed a decode step
    assert any(pair["rungs"]["ours"][rate]["ttft_pred_mae_s"] is not None for rate in ("2.0", "4.0"))
    assert len(report["runs"]) == 4
    # the order flips from rung to rung
    firsts = [r["server"] for r in report["runs"] if r["position"] == 0]
    assert firsts == ["ours", "ours-peer"]
    printed = capsys.readouterr().out
    assert out.with_suffix(".png").exists() or "no PNG: matplotlib is not installed" in printed
    assert "| rate req/s | server | attainment | goodput req/s |" in printed
    assert "- capacity (attainment >= 90%): ours" in printed and "goodput beyond capacity" in printed


def test_the_plot_draws_goodput_against_rate_per_server(tmp_path: Path):
    pytest.importorskip("matplotlib")
    rungs = {str(r): {"offered_rps": r, "goodput_rps": min(r, 2.0)} for r in (1.0, 2.0, 3.0)}
    pair = {"label": "TTFT <= 2 s, TPOT <= 100 ms", "rungs": {"ours": rungs, "vllm": rungs}}
    pair["capacity"] = {"ours": {"rps": 2.0}, "vllm": {"rps": None}}
    report = {"config": {"rate_list": [1.0, 2.0, 3.0]}, "slo_pairs": [pair, pair]}
    path = sr.plot(report, tmp_path / "slo.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
