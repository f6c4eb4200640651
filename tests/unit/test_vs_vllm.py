"""bench.vs_vllm's verdicts: the ratios and targets per concurrency, and the greedy-output check."""

from __future__ import annotations

from bench.stats import RequestRecord
from bench.vs_vllm import compare_outputs, markdown, table_rows


def summary(tok_s: float, tpot: float, ttft_p90: float) -> dict:
    return {"output_tokens_per_s": tok_s, "tpot_s": {"p50": tpot}, "ttft_s": {"p90": ttft_p90}}


def test_targets_are_judged_per_concurrency_on_the_median_round():
    samples = {
        # concurrency 1 needs 1.0x tok/s: met at exactly the peer's rate
        ("ours", 1): [summary(20.0, 0.050, 0.2)],
        ("vllm", 1): [summary(20.0, 0.050, 0.3)],
        # concurrency 16 needs 1.1x: 1.05x is not enough; medians of three rounds decide
        ("ours", 16): [summary(63.0, 0.140, 5.0), summary(10.0, 0.9, 50.0), summary(63.0, 0.140, 5.0)],
        ("vllm", 16): [summary(60.0, 0.150, 10.0), summary(60.0, 0.150, 10.0), summary(60.0, 0.150, 10.0)],
    }
    rows = {r["concurrency"]: r for r in table_rows(samples, [1, 16], "vllm")}
    assert rows[1]["targets"] == {"tok/s >= 1.0x": True, "TPOT p50 <= 1.0x": True, "TTFT p90 <= 0.7x": True}
    assert rows[16]["tok_s_ratio"] == 63.0 / 60.0
    assert rows[16]["targets"] == {"tok/s >= 1.1x": False, "TPOT p50 <= 1.0x": True, "TTFT p90 <= 0.7x": True}
    assert rows[16]["tok_s_ratio_per_round"][1] == 10.0 / 60.0
    table = markdown(list(rows.values()), "vllm")
    assert "| 16 | 63.0 | 60.0 | 1.05x |" in table and "NO (tok/s >= 1.1x)" in table


def record(index: int, text: str) -> RequestRecord:
    return RequestRecord(index, 10, 4, 0.0, ttft_s=0.1, e2e_s=0.5, output_tokens=4, text=text)


def test_differing_greedy_outputs_are_reported_with_where_they_part():
    ours = [record(0, "The cat sat"), record(1, "Hello world"), record(2, "abc\ufffd")]
    peer = [record(0, "The cat sat"), record(1, "Hello there"), record(2, "abc")]
    result = compare_outputs(ours, peer)
    assert result["equal"] == 2  # a held-back partial character at the end is no difference
    [diff] = result["differing"]
    assert diff["index"] == 1 and diff["first_diff_char"] == 6
    assert diff["ours"].endswith("world") and diff["peer"].endswith("there")


def test_a_run_waits_until_a_server_and_its_children_stop_spinning():
    """A server still busy after its load (vLLM's worker polls for about a second) would share the cores
    with the next system's run: settle waits for its whole process tree to go quiet."""
    import subprocess
    import sys

    from bench.server_process import settle

    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"
    # the spinning process is a child of the "server", as vLLM's worker is of its API server
    server = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    parent = subprocess.Popen([sys.executable, "-c", server])
    try:
        waited = settle([parent.pid], window_s=0.25, limit_s=10)
        assert 0.8 < waited < 5
        assert parent.wait(timeout=5) == 0
    finally:
        parent.kill()
    assert settle([parent.pid], window_s=0.25) < 0.5  # gone (or idle): one window
