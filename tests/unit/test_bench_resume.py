"""bench.resume's arithmetic: the gaps of a stream's timeline around a kill, the replica a stream is put on,
and the figures of a round's streams (the killed replica's against the others')."""

from __future__ import annotations

import pytest

from bench import resume
from bench.resume import Stream, attribute, figures, pooled, stream_gaps, stream_rows, table


def test_a_resumed_stream_s_gaps_around_the_kill():
    # tokens every 50 ms until 1.00, the kill at 1.02, the new replica's first token at 1.30, then every 60 ms
    times = [0.8, 0.85, 0.9, 0.95, 1.0, 1.3, 1.36, 1.42]
    g = stream_gaps(times, 1.02)
    assert g is not None
    assert g["next_s"] == pytest.approx(0.28) and g["resume_s"] == pytest.approx(0.28)
    assert g["stall_s"] == pytest.approx(0.30)  # last token before → the next one
    assert g["tpot_before_s"] == pytest.approx(0.05) and g["tpot_after_s"] == pytest.approx(0.06)
    assert (g["tokens_before"], g["tokens_after"]) == (5, 3)


def test_tokens_already_on_their_way_come_first_and_the_resume_is_the_gap_after_them():
    # two tokens the dead replica had sent arrive 10 and 20 ms after the kill; the new replica's at 0.5 s
    times = [0.9, 1.0, 1.01, 1.02, 1.5, 1.55]
    g = stream_gaps(times, 1.0)
    assert g is not None
    assert g["next_s"] == pytest.approx(0.01)
    assert g["stall_s"] == pytest.approx(0.48) and g["resume_s"] == pytest.approx(0.5)


def test_the_longest_gap_is_looked_for_within_the_window_only():
    late = 1.0 + resume.STALL_WINDOW_S + 1.0
    g = stream_gaps([0.95, 1.0, 1.05, late], 1.0)  # a hiccup after the window is not the resume
    assert g is not None and g["stall_s"] == pytest.approx(0.05) and g["resume_s"] == pytest.approx(0.05)
    g = stream_gaps([0.95, 1.0, late], 1.0)  # nothing within the window: the next token ends the gap
    assert g is not None and g["stall_s"] == pytest.approx(late - 1.0) and g["resume_s"] == pytest.approx(late - 1.0)


def test_a_stream_without_tokens_on_both_sides_of_the_kill_has_no_gaps():
    assert stream_gaps([0.1, 0.2], 0.5) is None  # finished before the kill
    assert stream_gaps([0.6, 0.7], 0.5) is None  # began after it
    assert stream_gaps([], 0.5) is None
    g = stream_gaps([0.4, 0.6], 0.5)
    assert g is not None and g["tpot_before_s"] is None and g["tpot_after_s"] is None


def test_a_stream_s_replica_is_the_one_whose_counter_rose_most():
    assert attribute([10, 20, 30], [10, 27, 30]) == 1
    assert attribute([10, 20, 30], [12, 20, 39]) == 2
    assert attribute([10, 20, 30], [10, 20, 30]) is None


def stream(index: int, replica: int, times: list[float], text: str = "abc", error: str | None = None) -> Stream:
    return Stream(index, f"prompt {index}", times=times, parts=[text], replica=replica, error=error)


def test_a_round_s_figures_split_the_killed_replica_s_streams_from_the_others():
    kill = 1.0
    streams = [
        stream(0, 0, [0.8, 0.9, 1.0, 1.2, 1.3]),  # killed: 200 ms gap, TPOT before 100 ms
        stream(1, 0, [0.9, 0.95, 1.4, 1.45]),  # killed: 450 ms gap, TPOT before 50 ms
        stream(2, 0, [0.1, 0.2]),  # on the killed replica but finished before the kill
        stream(3, 1, [0.9, 0.95, 1.0, 1.05, 1.1]),  # elsewhere: 50 ms gaps
        stream(4, 2, [0.9, 1.01], error="APIError: lost"),  # an error the client saw
        stream(5, 0, [0.9, 0.99, 1.3], text="other"),  # killed, but its text differs from the unbroken run's
    ]
    unbroken = ["abc", "abc", "abc", "abc", "abc", "abc"]
    rows = stream_rows(streams, kill, 0, unbroken)
    assert [r["on_killed"] for r in rows] == [True, True, True, False, False, True]
    x = figures(rows)
    assert (x["on_killed_replica"], x["mid_answer_on_killed"], x["finished_before_kill"]) == (4, 3, 1)
    assert x["client_errors"] == 1
    assert x["stall_s"]["n"] == 3 and x["stall_s"]["max"] == pytest.approx(0.45)
    assert x["stall_s"]["p50"] == pytest.approx(0.31)  # 0.2, 0.31, 0.45
    assert x["resume_s"]["p50"] == pytest.approx(0.3)  # 0.2, 0.3, 0.4
    assert x["resume_s"]["p90"] == pytest.approx(0.38)
    assert x["stall_over_tpot"]["max"] == pytest.approx(9.0)  # 450 ms over 50 ms
    assert x["others_stall_s"]["n"] == 1 and x["others_stall_s"]["p50"] == pytest.approx(0.05)
    assert x["same_text_resumed"] == [3, 4] and x["same_text_all"] == [4, 6]


def test_without_an_unbroken_run_texts_are_not_judged_and_rounds_pool():
    rows = stream_rows([stream(0, 1, [0.5, 1.5])], 1.0, 1, None)
    assert "same_text" not in rows[0] and figures(rows)["same_text_resumed"] is None
    one = {**figures(rows), "round": 0, "streams": rows, "resumed": 1.0, "gateway_lost": 0.0}
    one |= {"gateway_resume_seconds": 0.2, "gateway_resume_seconds_sum_count": [0.2, 1.0], "load": "1.0"}
    two = {**one, "round": 1, "gateway_resume_seconds": 0.4, "gateway_resume_seconds_sum_count": [0.8, 2.0]}
    total = pooled([one, two])
    assert total["resumed"] == 2 and total["mid_answer_on_killed"] == 2
    assert total["gateway_resume_seconds"] == pytest.approx(1.0 / 3)
    lines = table([one, two], total).splitlines()
    assert len(lines) == 5 and lines[-1].startswith("| all |") and "| 500 / 500 / 500 |" in lines[-1]
