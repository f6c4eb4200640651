"""Scheduling for the SLO (slo_schedule.py): online prefill chunks sized to the running decodes'
TPOT slack, growing for a prompt that needs more to make its TTFT, and waiting prompts by TTFT
deadline, the ones that can no longer make it behind those that can."""

import time

from goodput_runtime.engine.batch_cap import StepTimeModel
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.engine.slo_schedule import AGEING, MIN_CHUNK, SloSchedule
from goodput_runtime.sampling import SamplingParams

DECODE_FIXED, PER_SEQ, PER_TOKEN = 0.010, 0.001, 0.0002  # seconds: the step-time model taught below


def timed_model() -> StepTimeModel:
    model = StepTimeModel()
    for _ in range(5):
        for n in (1, 4):
            model.observe(n, 0, DECODE_FIXED + PER_SEQ * n)
    model.observe(1, 1000, DECODE_FIXED + PER_SEQ + PER_TOKEN * 1000)
    return model


def make(slo: SloSchedule | None, budget: int = 2048, max_num_seqs: int = 8) -> Scheduler:
    s = Scheduler(BlockManager(512, 16), max_num_seqs, budget, 4096, frozenset({2}))
    s.slo = slo
    return s


def request(rid: str, prompt_len: int, arrival: float | None = None, max_tokens: int = 50) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    base = 100 + 97 * (sum(map(ord, rid)) % 40)  # prompts of their own: no prefix-cache hits between them
    arrival = time.monotonic() if arrival is None else arrival
    return Sequence.new(rid, [base + i % 90 for i in range(prompt_len)], params, arrival)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    for item in out.scheduled:
        if item.samples and item.seq.times.first_token is None:
            item.seq.times.first_token = time.monotonic()
    return out


def planned(out: SchedulerOutput) -> dict[str, int]:
    return {item.seq.request_id: item.num_tokens for item in out.scheduled}


def with_decodes(slo: SloSchedule | None, n: int = 4) -> Scheduler:
    s = make(slo)
    for i in range(n):
        s.add(request(f"running{i}", 32))
    step(s)  # their prefills: from now on they decode
    return s


def test_a_long_prompt_beside_running_decodes_takes_the_tokens_their_tpot_leaves():
    slo = SloSchedule(ttft_target=10.0, tpot_target=0.1, model=timed_model())
    s = with_decodes(slo)
    s.add(request("long", 1500))
    out = planned(step(s))
    step_s = DECODE_FIXED + PER_SEQ * 4
    expected = int((0.1 * (1 - slo.margin) - step_s) / PER_TOKEN)
    assert out["long"] == expected < 1500
    assert all(out[f"running{i}"] == 1 for i in range(4))
    # the same prompt without the SLO's scheduling takes the whole budget left after the decodes
    plain = with_decodes(None)
    plain.add(request("long", 1500))
    assert planned(step(plain))["long"] == 1500


def test_the_chunk_keeps_to_the_floor_when_the_decodes_have_no_slack():
    slo = SloSchedule(ttft_target=60.0, tpot_target=0.012, model=timed_model())
    s = with_decodes(slo)
    s.add(request("long", 1500))
    assert planned(step(s))["long"] == MIN_CHUNK


def test_a_prompt_near_its_ttft_deadline_gets_the_chunk_it_needs():
    slo = SloSchedule(ttft_target=0.45, tpot_target=0.1, model=timed_model())
    s = with_decodes(slo)
    s.add(request("urgent", 1500))
    taken = planned(step(s))["urgent"]
    slack = int((0.1 * (1 - slo.margin) - (DECODE_FIXED + PER_SEQ * 4)) / PER_TOKEN)
    assert taken > slack  # in chunks of the slack alone it would take 0.40 s
    steps = 1500 / taken  # it aims inside its target by the margin
    assert steps * (DECODE_FIXED + PER_SEQ * 4) + 1500 * PER_TOKEN <= 0.45 * (1 - slo.margin)


def test_a_prompt_that_can_no_longer_make_its_ttft_waits_behind_one_that_can():
    slo = SloSchedule(ttft_target=1.0, tpot_target=None, model=timed_model())
    s = make(slo, max_num_seqs=1)
    s.add(request("holder", 16))
    step(s)  # the one seat is taken
    now = time.monotonic()
    s.add(request("lost", 200, arrival=now - 1.5))  # its deadline has passed
    s.add(request("fresh", 200, arrival=now))
    s.finish(s.running[0], "stop")
    assert set(planned(step(s))) == {"fresh"}
    # arrival order without the SLO's scheduling
    plain = make(None, max_num_seqs=1)
    plain.add(request("lost", 200, arrival=now - 1.5))
    plain.add(request("fresh", 200, arrival=now))
    assert set(planned(step(plain))) == {"lost"}


def test_earliest_deadline_first_among_those_that_can_make_it_and_ageing_bounds_the_wait():
    now = time.monotonic()
    slo = SloSchedule(ttft_target=1.0, tpot_target=None, model=timed_model())
    waiting = [
        request("later", 10, arrival=now - 0.1),
        request("sooner", 10, arrival=now - 0.5),
        request("lost", 10, arrival=now - 2.0),
    ]
    assert slo.next_waiting(waiting, now, 4).request_id == "sooner"
    aged = request("aged", 10, arrival=now - AGEING * 1.0 - 0.1)
    assert slo.next_waiting([*waiting, aged], now, 4).request_id == "aged"
    # a request preempted after its first token has no TTFT to meet: it keeps the front
    resumed = request("resumed", 10, arrival=now - 10.0)
    resumed.times.first_token = now - 9.0
    assert slo.next_waiting([*waiting, resumed], now, 4).request_id == "resumed"


def test_no_limit_on_prompts_while_no_online_request_decodes_or_before_costs_are_timed():
    slo = SloSchedule(ttft_target=10.0, tpot_target=0.1, model=timed_model())
    s = make(slo)
    s.add(request("first", 1500))
    assert planned(step(s))["first"] == 1500
    untimed = with_decodes(SloSchedule(ttft_target=10.0, tpot_target=0.1))
    untimed.add(request("long", 1500))
    assert planned(step(untimed))["long"] == 1500


def own(rid: str, prompt_len: int, arrival: float | None = None, ttft: float | None = None, tpot: float | None = None):
    """A request carrying its own targets (x-goodput-slo-ttft-ms / -tpot-ms, in seconds here)."""
    seq = request(rid, prompt_len, arrival)
    seq.params = SamplingParams(
        max_tokens=seq.params.max_tokens, temperature=0.0, ignore_eos=True, slo_ttft=ttft, slo_tpot=tpot
    )
    return seq


def test_a_requests_own_ttft_target_sets_its_deadline():
    """The service's 10 s TTFT gives the earlier arrival the later deadline than a request of its own 0.5 s."""
    now = time.monotonic()
    slo = SloSchedule(ttft_target=10.0, tpot_target=None, model=timed_model())
    early, tight = request("early", 10, arrival=now - 0.1), own("tight", 10, arrival=now, ttft=0.5)
    assert slo.next_waiting([early, tight], now, 4).request_id == "tight"
    # its own target ages it too: past AGEING of its own 0.5 s, it goes first even when it is lost
    lost = own("lost", 10, arrival=now - AGEING * 0.5 - 0.1, ttft=0.5)
    assert slo.next_waiting([early, tight, lost], now, 4).request_id == "lost"


def test_the_tightest_own_tpot_among_the_decodes_sizes_the_chunk_even_without_service_targets():
    for service_tpot in (0.1, None):
        slo = SloSchedule(ttft_target=None, tpot_target=service_tpot, model=timed_model())
        s = make(slo)
        for i in range(3):
            s.add(request(f"running{i}", 32))
        s.add(own("strict", 32, tpot=0.05))
        step(s)  # the prefills: all four decode from now on
        s.add(request("long", 1500))
        taken = planned(step(s))["long"]
        step_s = DECODE_FIXED + PER_SEQ * 4
        assert taken == int((0.05 * (1 - slo.margin) - step_s) / PER_TOKEN), service_tpot
