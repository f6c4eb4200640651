"""Batch work (priority above 0) yields to online requests: admission, budget, preemption, and the cap on
batch sequences beside online ones from the measured step time."""

import time

import pytest

from goodput_runtime.engine.batch_cap import BatchCap
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import SeqStatus, Sequence
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes
from goodput_runtime.sampling import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, 256, frozenset({2}))


def request(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority)
    base = 100 + 60 * (sum(map(ord, rid)) % 50)  # prompts of their own: no prefix-cache hits between them
    return Sequence.new(rid, [base + i % 50 for i in range(prompt_len)], params, 0.0)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [7 if item.samples else None for item in out.scheduled])
    return out


def planned(out: SchedulerOutput) -> dict[str, int]:
    return {item.seq.request_id: item.num_tokens for item in out.scheduled}


def test_an_online_request_is_admitted_before_batch_requests_that_arrived_earlier():
    s = make(budget=8)
    for i in range(3):
        s.add(request(f"batch{i}", 8, priority=1))
    s.add(request("online", 8))
    assert planned(step(s)) == {"online": 8}


def test_batch_requests_wait_while_an_online_request_waits_for_a_seat():
    s = make(max_num_seqs=1, budget=64)
    s.add(request("online-a", 4, max_tokens=50))
    step(s)
    s.add(request("batch", 4, priority=1))
    s.add(request("online-b", 4))
    # no seat: online-b waits, and batch (ahead of it in arrival) is not admitted past it
    assert set(planned(step(s))) == {"online-a"}
    assert [q.request_id for q in s.waiting] == ["batch", "online-b"]


def test_no_budget_goes_to_a_batch_prefill_while_an_online_request_waits():
    s = make(max_num_seqs=2, budget=16)
    batch = request("batch", 40, priority=1)
    s.add(batch)
    assert planned(step(s)) == {"batch": 2}  # an eighth of the budget
    s.add(request("online-a", 4, max_tokens=50))
    step(s)
    s.add(request("online-b", 4))
    out = step(s)  # online-b waits for a seat: the batch prefill pauses, online-a decodes
    assert "batch" not in planned(out)
    assert planned(out)["online-a"] == 1


def test_a_step_that_admits_an_online_request_runs_no_batch_decode():
    s = make(budget=64)
    s.add(request("batch", 4, priority=1, max_tokens=20))
    step(s)
    assert planned(step(s)) == {"batch": 1}  # decoding
    s.add(request("online", 6))
    assert planned(step(s)) == {"online": 6}
    assert planned(step(s)) == {"batch": 1, "online": 1}  # both decode once nobody waits


def test_batch_prefills_get_at_most_an_eighth_of_the_step_budget():
    s = make(budget=64)
    s.add(request("batch-a", 20, priority=1))
    s.add(request("batch-b", 20, priority=1))
    assert planned(step(s)) == {"batch-a": 8}
    assert planned(step(s)) == {"batch-a": 8}
    s.add(request("online", 20))
    assert planned(step(s)) == {"online": 20}  # online prefills take the whole budget


def test_when_blocks_run_out_a_batch_request_is_preempted_not_an_online_one():
    s = make(num_blocks=6, block_size=4, budget=64)
    online = request("online", 8, max_tokens=30)
    s.add(online)
    step(s)
    batch = request("batch", 8, priority=1, max_tokens=30)
    s.add(batch)
    step(s)
    late_online = request("online-late", 4, max_tokens=30)
    s.add(late_online)  # admitted after the batch request: plain last-in order would preempt it first
    for _ in range(10):
        if step(s).num_preempted:
            break
    assert batch.num_preemptions == 1
    assert online.num_preemptions == late_online.num_preemptions == 0


def test_an_online_request_takes_the_blocks_of_a_running_batch_request():
    s = make(num_blocks=4, block_size=4, budget=128)
    batch = request("batch", 12, priority=1, max_tokens=20)
    s.add(batch)
    step(s)  # batch holds 3 of the 4 blocks
    s.add(request("online", 8))  # needs 2
    out = step(s)
    assert "online" in planned(out) and "batch" not in planned(out)
    assert batch.status is SeqStatus.WAITING and batch.num_preemptions == 1


def test_batch_requests_are_served_in_arrival_order_among_themselves():
    s = make(max_num_seqs=1, budget=64)
    for i in range(3):
        s.add(request(f"b{i}", 4, priority=1, max_tokens=1))
    order = [next(iter(planned(step(s)))) for _ in range(3)]
    assert order == ["b0", "b1", "b2"]


def test_metrics_split_requests_and_the_queue_by_priority_and_the_slo_series_count_online_only():
    m = RuntimeMetrics("m", slo_ttft=0.5, slo_tpot=None)
    m.record_finished(RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.2, finished=1.0, priority=0))
    m.record_finished(RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=3.0, finished=4.0, priority=1))
    m.record_step(
        running=1, waiting=5, kv_usage=0.1, prompt_tokens=0, generation_tokens=0, preemptions=0, waiting_batch=3
    )
    value = m.registry.get_sample_value
    assert value("goodput_requests_by_priority_total", {"model": "m", "priority": "online", "outcome": "success"}) == 1
    assert value("goodput_requests_by_priority_total", {"model": "m", "priority": "batch", "outcome": "success"}) == 1
    assert value("goodput_requests_good_by_priority_total", {"model": "m", "priority": "online"}) == 1
    assert value("goodput_requests_good_by_priority_total", {"model": "m", "priority": "batch"}) == 0
    assert value("goodput_requests_waiting_by_priority", {"model": "m", "priority": "online"}) == 2
    assert value("goodput_requests_waiting_by_priority", {"model": "m", "priority": "batch"}) == 3
    # the SLO series count online requests only: batch work never shows the autoscaler a queue or a miss
    assert value("goodput_requests_total", {"model": "m", "outcome": "success"}) == 1
    assert value("goodput_requests_good_total", {"model": "m"}) == 1
    assert value("goodput_time_to_first_token_seconds_count", {"model": "m"}) == 1
    assert value("goodput_requests_waiting", {"model": "m"}) == 2


# --- the batch cap: batch sequences beside online ones, from the measured step time and the TPOT target


def timed_cap(
    tpot_target: float, fixed: float = 0.01, per_seq: float = 0.01, per_token: float = 0.001, margin: float = 0.0
) -> BatchCap:
    """A cap whose step-time model has measured steps costing fixed + per_seq · n + per_token · p seconds."""
    cap = BatchCap(tpot_target, margin)
    for n in (1, 2, 4, 8):
        for _ in range(5):
            cap.observe(n, 0, fixed + per_seq * n)
    cap.observe(2, 100, fixed + per_seq * 2 + per_token * 100)
    return cap


def capped(cap: BatchCap, max_num_seqs: int = 16, budget: int = 64) -> Scheduler:
    s = make(num_blocks=256, max_num_seqs=max_num_seqs, budget=budget)
    s.batch_cap = cap
    return s


def decoding(s: Scheduler, prefix: str, count: int, priority: int, max_tokens: int = 40) -> list[Sequence]:
    """`count` requests admitted and past their prefill."""
    seqs = [request(f"{prefix}{i}", 4, priority=priority, max_tokens=max_tokens) for i in range(count)]
    for seq in seqs:
        s.add(seq)
    for _ in range(4 * count):
        if all(q.num_output_tokens for q in seqs):
            break
        step(s)
    assert all(q.num_output_tokens for q in seqs)
    return seqs


def batch_in(out: SchedulerOutput) -> list[str]:
    return [item.seq.request_id for item in out.scheduled if item.seq.params.priority > 0]


def test_the_step_time_model_learns_fixed_per_sequence_and_per_token_costs():
    cap = timed_cap(1.0, fixed=0.02, per_seq=0.005, per_token=0.0004)
    assert abs(cap.model.fixed - 0.02) < 1e-9 and abs(cap.model.per_seq - 0.005) < 1e-9
    assert abs(cap.model.predict(30) - 0.17) < 1e-9  # extrapolated past the sizes measured
    assert abs(cap.model.predict(2, 50) - (0.03 + 0.02)) < 1e-9


def test_the_cap_is_the_most_batch_sequences_whose_step_stays_within_the_budget():
    cap = timed_cap(0.1, margin=0.2)  # budget 0.08 s: 0.01 + 0.01 · n ≤ 0.08 → n ≤ 7
    assert cap.sequences(online=0) is None  # no online work: not capped
    assert cap.sequences(online=2) == 5
    assert cap.sequences(online=7) == 0
    assert cap.sequences(online=9) == 0  # online alone misses it: no batch beside it
    assert BatchCap(0.1).sequences(online=2) is None  # nothing measured yet: nothing to cap from


def test_the_online_steps_overhead_beyond_their_decodes_comes_off_the_cap():
    cap = timed_cap(0.06)
    assert cap.sequences(online=2) == 3
    for _ in range(200):  # steps decoding 2 online sequences beside an online prefill: 0.03 s beyond decoding
        cap.observe(2, 30, 0.06, online_decodes=2)
    assert cap.overhead == pytest.approx(0.03, rel=1e-3)
    assert cap.sequences(online=1) == 1  # 0.06 − 0.03 − 0.02 leaves one sequence's 0.01 s
    assert cap.sequences(online=2) == 0
    for _ in range(200):  # steps without online decodes teach nothing about the online requests' overhead
        cap.observe(4, 0, 0.2)
    assert cap.overhead == pytest.approx(0.03, rel=1e-3)


def test_an_online_request_behind_its_target_tightens_the_cap_while_it_can_still_make_it():
    cap = timed_cap(0.1)  # budget 0.1 s; 2 online decodes take 0.03 s, so 7 batch sequences fit
    # 5 tokens out, 0.5 s since the first: 4 steps of 0.125 s, behind; 5 tokens left at 0.08 s bring it to 0.1 s
    allowance = cap.allowance(0.5, 5, 10)
    assert allowance == pytest.approx(0.08)
    assert cap.sequences(2) == 7
    assert cap.sequences(2, [allowance]) == 5  # 0.03 + 0.01 · 5 ≤ 0.08
    assert cap.sequences(2, [0.15]) == 7  # ahead of its target: the budget as it is
    assert cap.sequences(2, [0.02]) == 7  # lost whatever the batch does: no reason to stop it
    assert cap.allowance(0.5, 10, 10) is None  # nothing left to generate


def test_the_scheduler_reads_each_online_requests_pace_since_its_first_token():
    s = capped(timed_cap(0.1))
    decoding(s, "batch", 8, priority=1)
    online = decoding(s, "online", 2, priority=0)
    assert len(batch_in(step(s))) == 7
    assert [seq.num_output_tokens for seq in online] == [2, 2]
    for seq in online:  # as the engine sets it when the first token is sampled: 1 s ago, for 1 token since
        seq.times.first_token = time.monotonic() - 1.0
    # far behind 0.1 s: its 38 tokens left must average (0.1 · 39 − 1) / 38 = 0.076 s, 4 batch sequences' worth
    assert len(batch_in(step(s))) == 4


def test_no_more_batch_sequences_than_the_cap_step_beside_online_ones():
    s = capped(timed_cap(0.06))  # 0.01 + 0.01 · n ≤ 0.06: 5 sequences a step
    batch = decoding(s, "batch", 8, priority=1)
    assert len(batch_in(step(s))) == 8  # no online work: the batch fills the seats
    decoding(s, "online", 2, priority=0)
    for _ in range(3):
        out = step(s)
        assert len([i for i in out.scheduled if i.seq.params.priority == 0]) == 2  # online decodes all run
        assert batch_in(out) == ["batch0", "batch1", "batch2"]  # the earliest admitted, up to the cap
        assert out.batch_cap == 3 and out.batch_paused == 5
    # the paused ones keep their blocks and their place: paused, not preempted
    assert all(q.status is SeqStatus.RUNNING and q.num_preemptions == 0 and q.block_table for q in batch)


def test_batch_resumes_in_full_once_the_online_requests_finish():
    s = capped(timed_cap(0.06))
    batch = decoding(s, "batch", 8, priority=1)
    online = decoding(s, "online", 2, priority=0, max_tokens=4)
    paused_tokens = batch[-1].num_output_tokens
    while any(not q.is_finished for q in online):
        step(s)
    assert batch[-1].num_output_tokens == paused_tokens  # it sat out every step beside online work
    out = step(s)
    assert len(batch_in(out)) == 8 and out.batch_cap is None and out.batch_paused == 0
    assert batch[-1].num_output_tokens == paused_tokens + 1


def test_batch_progresses_beside_online_work_that_leaves_room():
    s = capped(timed_cap(0.5))  # room for dozens of sequences
    batch = decoding(s, "batch", 4, priority=1)
    decoding(s, "online", 2, priority=0)
    before = [q.num_output_tokens for q in batch]
    out = step(s)
    assert len(batch_in(out)) == 4 and out.batch_paused == 0
    assert [q.num_output_tokens for q in batch] == [b + 1 for b in before]


def test_batch_requests_are_not_admitted_past_the_cap_while_online_work_runs():
    s = capped(timed_cap(0.06))  # 3 batch sequences beside 2 online ones
    decoding(s, "online", 2, priority=0)
    for i in range(6):
        s.add(request(f"late{i}", 4, priority=1))
    for _ in range(6):
        step(s)
    assert sum(1 for q in s.running if q.params.priority > 0) == 3
    assert s.num_waiting_batch == 3


def test_batch_prefills_beside_online_work_take_only_the_tokens_that_fit_the_step():
    # budget 0.06 s; 2 online decodes: 0.03 s, so 30 prompt tokens at 1 ms fit, beside 3 batch decodes 0
    s = capped(timed_cap(0.06), budget=2048)  # an eighth of the token budget would be 256 tokens
    decoding(s, "online", 2, priority=0)
    s.add(request("long-batch", 200, priority=1))
    out = step(s)
    assert planned(out)["long-batch"] == 30
    assert out.num_decodes == 2 and out.num_prompt_tokens == 30


def test_with_no_online_work_a_batch_prefill_still_keeps_the_step_within_the_budget():
    s = capped(timed_cap(0.06), budget=2048)
    s.add(request("long-batch", 200, priority=1))
    assert planned(step(s)) == {"long-batch": 50}  # (0.06 − 0.01) / 0.001; an arriving request waits for it


def test_steps_teach_the_model_what_they_cost():
    s = capped(BatchCap(0.1))
    decoding(s, "batch", 3, priority=1)
    out = s.schedule()
    assert out.num_decodes == 3 and out.num_prompt_tokens == 0
    s.observe_step(out, 0.042)
    assert s.batch_cap is not None and s.batch_cap.model.predict(3) == pytest.approx(0.042)


def test_the_cap_is_exported_as_gauges():
    m = RuntimeMetrics("m", slo_ttft=None, slo_tpot=0.1)
    m.record_batch_cap(3, 3, 5)
    value = m.registry.get_sample_value
    assert value("goodput_batch_running_cap", {"model": "m"}) == 3
    assert value("goodput_batch_running", {"model": "m"}) == 3
    assert value("goodput_batch_paused", {"model": "m"}) == 5
    m.record_batch_cap(2, 2, 6)
    assert value("goodput_batch_paused", {"model": "m"}) == 6
    assert value("goodput_batch_pauses_total", {"model": "m"}) == 11  # summed over steps
