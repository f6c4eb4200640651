"""SLO-aware admission's prediction, against the real scheduler and block manager (plain Python)."""

from types import SimpleNamespace

import pytest

from goodput_runtime.__main__ import admission_settings, parse_args
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.engine.slo_schedule import SloSchedule
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.admission import (
    MIN_FIT_SPREAD,
    PREDICTED_TPOT,
    Admission,
    AdmissionSettings,
    PrefillShare,
    StepRates,
    observe_step,
    predict,
    predict_tpot,
)
from goodput_runtime.server.errors import APIError

PREFILL_TOKEN_S = 0.001  # 1,000 prompt tokens/s
DECODE_STEP_S = 0.02


def make(num_blocks=256, block_size=4, max_num_seqs=4, budget=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, 4096)


def request(rid: str, prompt_len: int, max_tokens: int = 50, base: int = 10) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence.new(rid, [base + i % 50 for i in range(prompt_len)], params, 0.0)


def rates() -> StepRates:
    r = StepRates()
    r.prefill_token_seconds, r.decode_step_seconds = PREFILL_TOKEN_S, DECODE_STEP_S
    return r


def run_step(s: Scheduler) -> None:
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])


def test_nothing_is_predicted_until_a_decode_step_is_measured():
    s = make()
    assert predict(s, StepRates(), 100, 1) is None
    admission = Admission(AdmissionSettings(ttft_target=0.001))
    admission.check(SimpleNamespace(scheduler=s), 100, SamplingParams(max_tokens=5))


def test_an_idle_engine_predicts_the_request_s_own_prefill():
    p = predict(make(), rates(), 200, 1)
    assert p is not None
    assert p.ttft == pytest.approx(200 * PREFILL_TOKEN_S + 4 * DECODE_STEP_S)  # 4 steps of a 64-token budget
    assert p.seat == 0 and p.kv == 0


def test_prompts_waiting_ahead_add_their_prefill():
    s = make(max_num_seqs=64)
    for i in range(10):
        s.add(request(f"w{i}", 100))
    p = predict(s, rates(), 100, 1)
    assert p.prefill == pytest.approx(1100 * PREFILL_TOKEN_S + 18 * DECODE_STEP_S)


def test_a_batch_prefill_under_way_is_not_ahead_of_an_online_request():
    s = make(max_num_seqs=64, budget=64)
    batch = Sequence.new(
        "batch", [10 + i % 50 for i in range(1000)], SamplingParams(max_tokens=5, temperature=0.0, priority=1), 0.0
    )
    s.add(batch)
    run_step(s)  # admitted, its prefill under way
    assert batch.num_uncomputed_tokens > 900
    online = predict(s, rates(), 100, 1)
    assert online is not None and online.prefill == pytest.approx(100 * PREFILL_TOKEN_S + 2 * DECODE_STEP_S)
    behind = predict(s, rates(), 100, 1, priority=1)  # another batch request waits behind it
    assert behind is not None and behind.prefill > 1000 * PREFILL_TOKEN_S


def test_a_full_batch_waits_for_the_running_request_nearest_its_end():
    s = make(max_num_seqs=2)
    s.add(request("long", 8, max_tokens=40))
    s.add(request("short", 8, max_tokens=10))
    run_step(s)  # both prefilled, one token each
    p = predict(s, rates(), 8, 1)
    assert p.seat == pytest.approx(9 * DECODE_STEP_S)  # "short" has 9 tokens left
    # a request behind one already waiting needs both running requests gone
    s.add(request("queued", 8))
    assert predict(s, rates(), 8, 1).seat == pytest.approx(39 * DECODE_STEP_S)


def test_a_request_with_n_choices_needs_a_seat_for_each():
    s = make(max_num_seqs=4)
    s.add(request("a", 8, max_tokens=20))
    s.add(request("b", 8, max_tokens=30))
    run_step(s)
    assert predict(s, rates(), 8, 2).seat == 0
    assert predict(s, rates(), 8, 3).seat == pytest.approx(19 * DECODE_STEP_S)


def test_without_free_kv_blocks_it_waits_for_requests_that_free_enough():
    s = make(num_blocks=12, block_size=4, max_num_seqs=8)
    s.add(request("a", 16, max_tokens=5))  # 4 blocks, then a 5th
    s.add(request("b", 16, max_tokens=30))
    run_step(s)
    free = s.block_manager.num_free_blocks
    p = predict(s, rates(), 4 * free, 1)  # its prompt needs one block more than is free
    assert p.kv == pytest.approx(4 * DECODE_STEP_S)  # "a" frees its blocks after 4 more tokens


def test_a_request_predicted_past_the_target_gets_429_with_retry_after():
    s = make(max_num_seqs=64)
    for i in range(30):
        s.add(request(f"w{i}", 100))  # 3 s of prefill ahead
    admission = Admission(AdmissionSettings(ttft_target=1.0, margin=0.1))
    admission.rates = rates()
    engine = SimpleNamespace(scheduler=s)
    with pytest.raises(APIError) as refused:
        admission.check(engine, 100, SamplingParams(max_tokens=5))
    assert refused.value.status == 429
    assert refused.value.code == "slo_unattainable"
    assert int(refused.value.headers["Retry-After"]) >= 2  # 3.1 s predicted against a 0.9 s limit
    assert "1s target" in refused.value.message
    # a queue short enough is admitted
    s.waiting.clear()
    admission.check(engine, 100, SamplingParams(max_tokens=5))


def test_steps_teach_the_prefill_rate_decode_step_time_and_output_length():
    s = make()
    s.add(request("a", 40, max_tokens=3))
    r = StepRates()
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    observe_step(r, out.scheduled, 0.04)
    assert r.prefill_token_seconds is None  # no decode step timed yet to tell the step's fixed cost
    for _ in range(2):
        out = s.schedule()
        s.update(out, [7 for _ in out.scheduled])
        observe_step(r, out.scheduled, 0.01)
    assert r.decode_step_seconds == pytest.approx(0.01)
    assert r.output_tokens == 3  # the request finished in the last step
    assert predict(s, r, 40, 1).ttft == pytest.approx(0.01)  # one step; prompt tokens not yet priced
    # later prefills count a decode step's time as the step's fixed cost
    s.add(request("b", 40, max_tokens=3, base=100))  # no prefix shared with "a"
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    observe_step(r, out.scheduled, 0.05)
    assert r.prefill_token_seconds == pytest.approx((0.05 - 0.01) / 40)


def test_admission_is_on_by_default_for_the_server_targets_or_the_requests_own():
    # no server target: on, for the requests that carry their own (server/request_slo.py)
    assert admission_settings(parse_args(["--model", "m"])) == AdmissionSettings(None, 0.1)
    assert admission_settings(parse_args(["--model", "m", "--slo-ttft", "2"])) == AdmissionSettings(2.0, 0.1)
    assert admission_settings(parse_args(["--model", "m", "--slo-tpot", "0.1"])) == AdmissionSettings(None, 0.1, 0.1)
    assert admission_settings(parse_args(["--model", "m", "--slo-ttft", "2", "--admission", "off"])) is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--admission", "on"])


def tpot_engine(running: int, waiting: int = 0) -> SimpleNamespace:
    """Online requests decoding (and waiting) under the SLO's step-time model: 10 ms + 2 ms a sequence."""
    s = make(max_num_seqs=64, budget=4096)
    s.slo = SloSchedule(ttft_target=None, tpot_target=0.1)
    for _ in range(5):
        for n in (1, 16):
            s.slo.model.observe(n, 0, 0.010 + 0.002 * n)
    for i in range(running):
        s.add(request(f"r{i}", 8, base=10 + 60 * i))
    run_step(s)
    for i in range(waiting):
        s.add(request(f"w{i}", 8, base=3000 + 60 * i))
    return SimpleNamespace(scheduler=s)


def test_a_request_that_would_push_the_running_decodes_past_the_tpot_target_gets_429():
    admission = Admission(AdmissionSettings(ttft_target=None, margin=0.1, tpot_target=0.1))
    # 30 decoding + this one: 10 + 2 × 31 = 72 ms a token, within 90 ms, and the response says so
    headers = admission.check(tpot_engine(30), 8, SamplingParams(max_tokens=5))
    assert float(headers[PREDICTED_TPOT]) == pytest.approx(0.072)
    # 40 decoding, or 30 with 10 waiting to join: 92 ms, past it
    for engine in (tpot_engine(40), tpot_engine(30, waiting=10)):
        with pytest.raises(APIError) as refused:
            admission.check(engine, 8, SamplingParams(max_tokens=5))
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        assert refused.value.code == "tpot_unattainable"
        assert "100 ms target" in refused.value.message
    # batch work (priority above 0) is not refused for it: it waits behind online requests
    admission.check(tpot_engine(40), 8, SamplingParams(max_tokens=5, priority=1))
    # nor is a request to an idle engine, whatever the model says: a model learned on a busy
    # machine is only brought up to date by steps that run
    idle = tpot_engine(0, waiting=45)
    idle.scheduler.waiting.clear()
    admission.check(idle, 8, SamplingParams(max_tokens=5))


def test_prompt_work_in_the_last_window_stretches_the_predicted_tpot():
    engine = tpot_engine(20)  # 52 ms a token on its own
    share = PrefillShare(window_s=10.0)
    assert predict_tpot(engine.scheduler, share, 1) == pytest.approx(0.052)
    share.observe(5.0)  # half of the last 10 s went to prompt tokens: tokens come half as often
    assert predict_tpot(engine.scheduler, share, 1) == pytest.approx(0.104)
    assert share.share(now=share.samples[0][0] + 11.0) == 0.0  # and it leaves the window


def test_a_line_through_nearby_batch_sizes_is_not_carried_out_to_a_large_batch():
    """Steps of 1 to 3 sequences, timed with the noise of a real machine (a step mostly fixed cost),
    fit a steep line: carried to 21 sequences it would predict 130 ms and refuse. Admission takes
    their mean instead until sizes MIN_FIT_SPREAD apart are timed, and then the line."""
    engine = tpot_engine(0)
    model = engine.scheduler.slo.model
    model.sizes.clear()
    for _ in range(5):
        for n, seconds in ((1, 0.035), (2, 0.047), (3, 0.060)):
            model.observe(n, 0, seconds)
    assert model.decode_seconds(21) > 0.2  # the line's own prediction
    for i in range(20):
        engine.scheduler.add(request(f"r{i}", 8, base=10 + 60 * i))
    run_step(engine.scheduler)
    share = PrefillShare(window_s=10.0)
    assert predict_tpot(engine.scheduler, share, 1) == pytest.approx(model.mean_decode_seconds())
    admission = Admission(AdmissionSettings(ttft_target=None, margin=0.1, tpot_target=0.1))
    admission.check(engine, 8, SamplingParams(max_tokens=5))  # admitted
    for _ in range(5):  # a wide spread of sizes timed: the line, fixed 25 ms + 1 ms a sequence
        for n in (2, 40):
            model.observe(n, 0, 0.025 + 0.001 * n)
    assert model.size_spread >= MIN_FIT_SPREAD
    assert predict_tpot(engine.scheduler, share, 1) == pytest.approx(model.decode_seconds(21))
