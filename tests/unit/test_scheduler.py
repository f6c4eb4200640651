from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import SeqStatus, Sequence
from goodput_runtime.sampling import SamplingParams

EOS = 2


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, frozenset({EOS}))


def request(rid: str, prompt_len: int, max_tokens: int = 4, base: int = 10, **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Sequence.new(rid, [base + i % 50 for i in range(prompt_len)], params, 0.0)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """A step with a stand-in model that always samples `token`."""
    out = s.schedule()
    s.update(out, [token if item.samples else None for item in out.scheduled])
    return out


def planned(out: SchedulerOutput) -> dict[str, int]:
    return {item.seq.request_id: item.num_tokens for item in out.scheduled}


def test_running_decodes_go_first_then_waiting_prefills_within_the_budget():
    s = make(budget=10)
    a = request("a", 6)
    s.add(a)
    assert planned(step(s)) == {"a": 6}
    s.add(request("b", 20))
    # a decodes one token; b gets the remaining 9 of the budget
    assert planned(step(s)) == {"a": 1, "b": 9}


def test_a_prefill_larger_than_the_budget_is_chunked_and_samples_only_at_its_end():
    s = make(budget=8)
    a = request("a", 20)
    s.add(a)
    out = s.schedule()
    assert planned(out) == {"a": 8}
    assert not out.scheduled[0].samples
    s.update(out, [None])
    assert planned(step(s)) == {"a": 8}
    assert a.num_output_tokens == 0
    out = step(s)
    assert planned(out) == {"a": 4}
    assert a.num_output_tokens == 1


def test_new_requests_join_the_running_batch_and_finished_ones_leave_at_once():
    s = make()
    a = request("a", 4, max_tokens=2)
    s.add(a)
    step(s)
    s.add(request("b", 4, max_tokens=5))
    out = step(s)
    assert planned(out) == {"a": 1, "b": 4}
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "length"
    assert [q.request_id for q in s.running] == ["b"]
    assert a.block_table == []


def test_at_most_max_num_seqs_run_at_once():
    s = make(max_num_seqs=2, budget=100)
    for i in range(4):
        s.add(request(str(i), 4))
    step(s)
    assert len(s.running) == 2
    assert len(s.waiting) == 2


def test_running_out_of_blocks_preempts_the_most_recently_admitted_and_loses_nothing():
    s = make(num_blocks=6, block_size=4, budget=64)
    for i, rid in enumerate(("a", "b", "c")):
        s.add(request(rid, 7, max_tokens=12, base=100 * i))
    seqs = list(s.waiting)
    step(s)  # 3 x 2 blocks: the cache is full
    step(s)
    out = step(s)  # a needs a third block: c, admitted last, gives way
    assert out.num_preempted == 1
    assert planned(out) == {"a": 1, "b": 1}
    c = seqs[2]
    assert c.status is SeqStatus.WAITING and c.num_preemptions >= 1
    assert c.num_computed_tokens == 0 and c.block_table == []
    assert s.waiting[0] is c
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
    assert all(q.finish_reason == "length" and q.num_output_tokens == 12 for q in seqs)
    assert s.block_manager.num_free_blocks == 6


def test_stop_conditions():
    s = make()
    eos = request("eos", 4, max_tokens=10)
    ignore = request("ignore", 4, max_tokens=3, ignore_eos=True)
    stop_id = request("stop-id", 4, max_tokens=10, stop_token_ids=(7,))
    for q in (eos, ignore, stop_id):
        s.add(q)
    step(s, token=EOS)
    assert eos.finish_reason == "stop" and eos.num_output_tokens == 1
    assert ignore.status is SeqStatus.RUNNING
    step(s, token=7)
    assert stop_id.finish_reason == "stop"
    step(s, token=EOS)
    assert ignore.finish_reason == "length" and ignore.num_output_tokens == 3


def test_a_sequence_stops_at_the_maximum_model_length():
    s = make(max_model_len=8)
    a = request("a", 6, max_tokens=100)
    s.add(a)
    while s.has_unfinished():
        step(s)
    assert a.num_tokens == 8
    assert a.finish_reason == "length"


def test_finishing_a_waiting_request_removes_it_from_the_queue():
    s = make(max_num_seqs=1)
    a, b = request("a", 4), request("b", 4)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b, "abort")
    assert not s.waiting
    assert b.finish_reason == "abort"


def test_prefix_cache_hits_are_reported_on_first_admission():
    s = make(budget=64)
    s.add(request("a", 16, max_tokens=1))
    step(s)
    s.add(request("b", 16, max_tokens=1))
    out = step(s)
    assert out.prefix_queried_tokens == 16
    assert out.prefix_hit_tokens == 12
    assert planned(out) == {"b": 4}
