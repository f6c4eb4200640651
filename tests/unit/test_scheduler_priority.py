"""Batch work (priority above 0) yields to online requests: admission, budget and preemption."""

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
    m.record_step(running=1, waiting=5, kv_usage=0.1, prompt_tokens=0, generation_tokens=0, preemptions=0,
                  waiting_batch=3)
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
