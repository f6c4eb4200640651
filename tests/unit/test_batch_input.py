"""Batch input files are checked line by line as OpenAI checks them; the concurrency law backs off."""

from __future__ import annotations

import json

import pytest

from goodput_gateway.batch.control import AIMD, ReplicaSignals, parse_signals
from goodput_gateway.batch.validate import parse_input
from goodput_gateway.errors import APIError


def line(custom_id="a", url="/v1/chat/completions", model="tiny", **extra) -> str:
    item = {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
        **extra,
    }
    return json.dumps(item)


def refused(*lines: str) -> APIError:
    with pytest.raises(APIError) as err:
        parse_input("\n".join(lines).encode())
    assert err.value.status == 400
    return err.value


def test_a_good_file_gives_its_lines_model_and_url():
    parsed = parse_input(f"{line('a')}\n\n{line('b')}\n".encode())
    assert [x.custom_id for x in parsed.lines] == ["a", "b"]
    assert parsed.model == "tiny" and parsed.url == "/v1/chat/completions"


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        (line("a"), "custom_id 'a' is used by an earlier line"),
        (line("c", url="/v1/images/generations"), "'url' must be one of"),
        (line("c", model="other"), "same model"),
        (line("c", url="/v1/completions"), "same url"),
        (line("c", extra=1), "unknown field 'extra'"),
        (
            json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}),
            "'method' must be POST",
        ),
    ],
)
def test_the_first_bad_line_is_refused_with_its_number(bad, words):
    err = refused(line("a"), line("b"), bad)
    assert err.message.startswith("Line 3: ")
    assert words in err.message


def test_an_empty_file_is_refused():
    assert refused("", "  ").code == "empty_file"


def test_concurrency_grows_while_online_is_healthy_and_halves_when_online_waits():
    aimd = AIMD(per_replica_cap=4)
    healthy = {"r": ReplicaSignals(online_total=10, online_good=10, seen=True)}
    limits = [aimd.update(healthy) for _ in range(5)]
    assert limits == [2, 3, 4, 4, 4]  # +1 a period, capped at 4 per replica
    queued = {"r": ReplicaSignals(online_waiting=2, online_total=10, online_good=10, seen=True)}
    assert aimd.update(queued) == 4  # one read with a queue: a request between steps
    assert aimd.update(queued) == 2  # a queue that persists: halve
    # attainment in the last period (5 good of 10 finished) below the target: halve again
    assert aimd.update({"r": ReplicaSignals(online_total=20, online_good=15, seen=True)}) == 1
    # a limit nobody uses does not grow: the next batch starts where the last one left off
    idle = {"r": ReplicaSignals(online_total=30, online_good=30, seen=True)}
    assert [aimd.update(idle, in_flight=0) for _ in range(3)] == [1, 1, 1]
    assert aimd.update(idle, in_flight=1) == 2


def test_replica_signals_read_online_series_and_fall_back_to_the_whole_queue():
    text = "\n".join(
        [
            'goodput_requests_waiting{model="m"} 5.0',
            'goodput_requests_waiting_by_priority{model="m",priority="online"} 1.0',
            'goodput_requests_waiting_by_priority{model="m",priority="batch"} 4.0',
            'goodput_requests_by_priority_total{model="m",priority="online",outcome="success"} 9.0',
            'goodput_requests_by_priority_total{model="m",priority="batch",outcome="success"} 90.0',
            'goodput_requests_good_by_priority_total{model="m",priority="online"} 8.0',
        ]
    )
    s = parse_signals(text)
    assert (s.online_waiting, s.online_total, s.online_good) == (1.0, 9.0, 8.0)
    assert parse_signals('vllm:num_requests_waiting{model_name="m"} 3.0').online_waiting == 3.0
