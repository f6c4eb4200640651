"""When to split prefill from decode: the model on the step times measured from our runtime.

The profile (bench/pd_profile.json) holds SmolLM2-135M-Instruct's measured step times on this machine
and their fit; these tests read it, so they check the committed measurement, not a made-up one.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import pd_sim
from goodput_operator.autoscaling import split
from goodput_operator.autoscaling.pd_fit import PROFILE
from goodput_operator.autoscaling.split import Mix, Slo, StepModel, recommend, slo_for

ROOT = Path(__file__).resolve().parents[2]
DOC = json.loads((ROOT / "bench" / "pd_profile.json").read_text())
MODEL = StepModel.from_profile(DOC)
# the fit's stated tolerance against the medians it was fitted to, on a shared two-core machine
TOLERANCE = {"prefill": 0.1, "decode": 0.3, "mixed": 0.1}


def mix(name: str) -> Mix:
    return next(m for m in pd_sim.mixes() if m.name == name)


def test_the_fit_reproduces_the_measured_step_times():
    points = DOC["points"]
    for p in points["prefill"]:
        assert MODEL.prefill(p["tokens"]) == pytest.approx(p["seconds"], rel=TOLERANCE["prefill"]), p
    for p in points["decode"]:
        assert MODEL.decode(p["batch"], p["context"]) == pytest.approx(p["seconds"], rel=TOLERANCE["decode"]), p
    for p in points["mixed"]:
        fitted = MODEL.mixed(p["batch"], p["context"], p["chunk"])
        assert fitted == pytest.approx(p["seconds"], rel=TOLERANCE["mixed"]), p
    # and the profile says where it came from
    assert "CPU" in DOC["measured"]["machine"] and DOC["measured"]["model"].startswith("SmolLM2")


def test_the_operator_carries_the_committed_fit():
    assert PROFILE["fit"] == DOC["fit"]
    assert StepModel.reference() == MODEL


def test_short_prompts_and_outputs_stay_aggregated():
    short = mix("short-chat")
    r = recommend(MODEL, short, slo_for(MODEL, short))
    assert (short.prompt, short.output) == (200, 200)
    assert not r.split, r
    assert r.aggregated > 0


def test_long_prompts_with_short_outputs_split():
    long = mix("long-prompt")
    r = recommend(MODEL, long, slo_for(MODEL, long, "long-context"))
    assert (long.prompt, long.output) == (8000, 256)
    assert r.split, r
    assert r.disaggregated > r.aggregated * (1 + split.SPLIT_MARGIN)
    assert r.prefill > r.decode  # the prompts are the work: more prefill replicas than decode ones


def test_interference_is_what_costs_aggregated_serving():
    # the same mix with a chunk that rides a decode step for free: aggregated serving can only gain,
    # and the split's own goodput does not move (its pools never mix the phases)
    long = mix("long-prompt")
    slo = slo_for(MODEL, long, "long-context")
    free = replace(MODEL, m=0.0)
    with_interference, without = recommend(MODEL, long, slo), recommend(free, long, slo)
    assert without.aggregated > with_interference.aggregated
    assert without.disaggregated == pytest.approx(with_interference.disaggregated)


def test_dynamo_ratio_follows_the_work_of_each_phase():
    long, reasoning = mix("long-prompt"), mix("reasoning")
    p, d = split.dynamo_ratio(MODEL, long, slo_for(MODEL, long))
    assert p > d
    p, d = split.dynamo_ratio(MODEL, reasoning, slo_for(MODEL, reasoning))
    assert p < d


def test_a_stricter_slo_serves_fewer_requests():
    chat = mix("production-chat")
    loose, strict = slo_for(MODEL, chat, scale=1.5), slo_for(MODEL, chat, scale=0.8)
    assert strict.ttft < loose.ttft and strict.tpot < loose.tpot
    assert recommend(MODEL, chat, strict).aggregated < recommend(MODEL, chat, loose).aggregated


def test_a_users_csv_is_a_mix(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,prompt_tokens,output_tokens\n0.0,8000,256\n0.5,8000,256\n1.25,8000,256\n")
    trace = pd_sim.csv_mix(path)
    assert trace.requests == ((8000, 256),) * 3
    # a summariser's trace under a summariser's targets splits; under a chat's tight TTFT it does not
    assert pd_sim.run(MODEL, [trace], 1.0, None, None, "long-context")[0]["recommended"] == "disaggregated"
    assert pd_sim.run(MODEL, [trace], 1.0, None, None, "interactive")[0]["recommended"] == "aggregated"
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,prompt_tokens,output_tokens\n0.0,many,3\n")
    with pytest.raises(SystemExit, match=r"bad\.csv:2"):
        pd_sim.csv_mix(bad)


def test_the_class_follows_the_services_own_targets():
    assert split.slo_class(15.0, 0.15) == "long-context"  # DistServe's summarisation targets
    assert split.slo_class(0.25, 0.1) == "interactive"  # its chatbot's
    assert split.slo_class(0.125, 0.2) == "interactive"  # its code completion's
    assert split.slo_class(None, 0.1) == "interactive"


def test_explicit_targets_apply_to_every_mix():
    rows = pd_sim.run(MODEL, [mix("short-chat")], 1.0, 30.0, 5.0)
    assert rows[0]["slo"]["ttftSeconds"] == 30.0 and rows[0]["slo"]["tpotSeconds"] == 5.0
    assert isinstance(Slo(1.0, 0.1).attainment, float)
