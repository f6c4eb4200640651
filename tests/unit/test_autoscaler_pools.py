"""A disaggregated service's two pools: each guard wakes on its own target's miss, scale-down consolidates,
start-up samples teach nothing, and the pools reach zero and wake together."""

from dataclasses import replace

from goodput_operator.autoscaling.law import DOWN, HOLD, UP
from goodput_operator.autoscaling.pools import (
    DECODE,
    PREFILL,
    PoolMemory,
    PoolReading,
    decide_pools,
)
from goodput_operator.autoscaling.state import Memory, Policy, Signals

BASE = Policy(  # minReplicas 0 with an idle period: both pools may rest at zero
    min_replicas=0,
    max_replicas=8,
    attainment_target=0.9,
    ttft_target=2.0,
    tpot_target=0.1,
    scale_down_window=300,
    idle_period=600,
)
POLICIES = {PREFILL: replace(BASE, max_replicas=4), DECODE: BASE}
PROMPT, OUTPUT = 1000.0, 250.0  # tokens per request
# learnt: one prefill replica serves 2 requests/s of 1,000-token prompts, one decode replica 4 requests/s of
# 250-token outputs (the law's capacity is in units of a request of the pool's first mix)
MEMORIES = {
    PREFILL: PoolMemory(Memory(capacity_per_replica=2.0), unit=PROMPT),
    DECODE: PoolMemory(Memory(capacity_per_replica=4.0), unit=OUTPUT),
}


def reading(pool: str, current: int, rate: float, attainment: float = 0.99, waiting: int = 0, **kw) -> PoolReading:
    """`rate` requests/s through the pool, as its pods' metrics show them."""
    size = PROMPT if pool == PREFILL else OUTPUT
    s = Signals(arrival_rate=rate, attainment=attainment, waiting=waiting, running=1 if rate else 0, finished=rate * 60)
    s = replace(s, **kw)
    return PoolReading(current, kw.pop("ready", current), s, rate * size, size if rate else None)


def both(prefill: PoolReading, decode: PoolReading, memories=MEMORIES, now: float = 1000.0, held=None):
    return decide_pools(POLICIES, {PREFILL: prefill, DECODE: decode}, memories, now, held)


def test_steady_load_holds_both_pools():
    out = both(reading(PREFILL, 2, 2.0), reading(DECODE, 2, 2.0))
    assert (out[PREFILL].desired, out[DECODE].desired) == (2, 2)
    assert out[PREFILL].direction == out[DECODE].direction == HOLD


def test_ttft_miss_wakes_only_the_prefill_guard():
    out = both(reading(PREFILL, 2, 2.0, attainment=0.6, waiting=8), reading(DECODE, 2, 2.0))
    assert out[PREFILL].direction == UP and out[PREFILL].term == "guard"
    assert out[PREFILL].desired == 3
    assert out[DECODE].desired == 2 and out[DECODE].term != "guard"


def test_tpot_miss_wakes_only_the_decode_guard():
    out = both(reading(PREFILL, 2, 2.0), reading(DECODE, 2, 2.0, attainment=0.5, waiting=6))
    assert out[DECODE].direction == UP and out[DECODE].term == "guard"
    assert out[PREFILL].desired == 2 and out[PREFILL].term != "guard"


def test_each_pool_is_sized_on_its_own_tokens():
    # 6 requests/s of long prompts need more prefill replicas; the decode pool's output tokens still fit 2
    out = both(reading(PREFILL, 2, 6.0), reading(DECODE, 2, 6.0 / 8))
    assert out[PREFILL].direction == UP and out[PREFILL].term == "capacity"
    assert 3 <= out[PREFILL].desired <= 4  # at most doubling, within maxReplicas 4
    assert out[DECODE].desired == 2
    assert "prompt tokens/s" in out[PREFILL].reason


def test_kv_memory_term_grows_the_decode_pool():
    out = both(reading(PREFILL, 2, 2.0), reading(DECODE, 2, 2.0, kv_usage=0.97))
    assert out[DECODE].term == "kv_memory" and out[DECODE].desired == 3
    assert "KV cache" in out[DECODE].reason


def test_scale_down_consolidates_only_while_the_rest_stay_under_plan():
    # 4 prefill replicas, load 1 request/s: three would carry it, but only after the stabilisation window
    early = replace(MEMORIES[PREFILL], memory=replace(MEMORIES[PREFILL].memory, high_since=900.0))
    memories = {**MEMORIES, PREFILL: early}
    out = both(reading(PREFILL, 4, 1.0), reading(DECODE, 2, 2.0), memories=memories, now=1000.0)
    assert out[PREFILL].desired == 4 and out[PREFILL].term == "stabilizing"
    out = both(reading(PREFILL, 4, 1.0), reading(DECODE, 2, 2.0), memories=memories, now=1300.0)
    assert out[PREFILL].direction == DOWN and out[PREFILL].desired == 3 and out[PREFILL].term == "consolidate"
    # a load that one fewer replica could not carry under plan keeps them all, however long it lasts
    out = both(reading(PREFILL, 4, 5.5), reading(DECODE, 2, 2.0), memories=memories, now=5000.0)
    assert out[PREFILL].desired == 4


def test_startup_samples_never_teach_capacity():
    # a pool with a replica still starting, met far above its plan: a settled pool would learn from it
    fast = reading(PREFILL, 3, 6.0)
    settled = both(replace(fast, current=2, ready=2), reading(DECODE, 2, 2.0))
    assert settled[PREFILL].memory.memory.capacity_per_replica > 2.0
    starting = both(replace(fast, current=3, ready=2), reading(DECODE, 2, 2.0))
    assert starting[PREFILL].memory.memory.capacity_per_replica == 2.0


def test_both_pools_reach_zero_together():
    idle = Memory(capacity_per_replica=2.0, idle_since=0.0, high_since=0.0)
    memories = {
        PREFILL: PoolMemory(idle, unit=PROMPT),
        DECODE: PoolMemory(replace(idle, capacity_per_replica=4.0), unit=OUTPUT),
    }
    # the decode pool has been idle past the idle period, the prefill pool still serves: decode waits at 1
    out = both(reading(PREFILL, 1, 0.5), reading(DECODE, 1, 0.0), memories=memories, now=1000.0)
    assert out[DECODE].desired == 1 and out[DECODE].term == "together"
    assert out[PREFILL].desired == 1
    # both idle: both go to zero in the same period
    out = both(reading(PREFILL, 1, 0.0), reading(DECODE, 1, 0.0), memories=memories, now=1000.0)
    assert (out[PREFILL].desired, out[DECODE].desired) == (0, 0)
    assert out[PREFILL].term == out[DECODE].term == "idle"


def test_both_pools_wake_together():
    at_zero = PoolReading(0, 0, None, missing="no ready pods")
    out = both(at_zero, at_zero, held=3)
    assert (out[PREFILL].desired, out[DECODE].desired) == (1, 1)
    assert out[PREFILL].term == out[DECODE].term == "wake"
    out = both(at_zero, at_zero, held=0)
    assert (out[PREFILL].desired, out[DECODE].desired) == (0, 0)
    # a pool left at zero while the other serves (say, after a restart) comes back with it
    out = both(at_zero, reading(DECODE, 2, 2.0))
    assert out[PREFILL].desired == 1 and out[PREFILL].term == "wake"


def test_the_pools_read_their_tokens_and_the_hand_off_from_the_runtimes_exposition():
    """The runtime's own metrics objects, scraped twice 10 s apart: token rates for each pool's demand, the
    hand-off's mean seconds (the prefill target is net of it), each pool's share within its own target."""
    from prometheus_client import CollectorRegistry, generate_latest

    from goodput_operator.autoscaling.pool_loop import _pool_reading
    from goodput_operator.autoscaling.signals import History, parse_pod_metrics
    from goodput_operator.autoscaling.sources import Reading
    from goodput_runtime.engine.kv_transfer.metrics import KVTransferMetrics
    from goodput_runtime.metrics import RuntimeMetrics
    from goodput_runtime.request_times import RequestTimes

    registry = CollectorRegistry()
    runtime = RuntimeMetrics("chat", 2.0, 0.1, registry=registry)
    handoff = KVTransferMetrics(registry, "chat")
    # the 2 s TTFT target net of a 1 s hand-off: 1 s, one of the runtime's buckets (elsewhere: interpolated)
    history = History(keep_seconds=600, slo_ttft=1.0, slo_tpot=0.1)
    history.add(0.0, {"pod": parse_pod_metrics(generate_latest(registry).decode())})
    for ttft in (0.2, 0.4, 0.9, 1.9):  # the last misses the net 1 s target
        runtime.record_finished(
            RequestTimes(
                arrival=0.0,
                first_scheduled=0.0,
                first_token=ttft,
                finished=ttft + 0.05 * 9,
                num_output_tokens=10,
                outcome="success",
            )
        )
        handoff.pulled("decode", 1.0)
        handoff.pulled("peer", 5.0)  # a peer pull on the same pod: not the hand-off's time
    runtime.record_step(running=0, waiting=0, kv_usage=0.1, prompt_tokens=4000, generation_tokens=40, preemptions=0)
    history.add(10.0, {"pod": parse_pod_metrics(generate_latest(registry).decode())})
    s = history.signals(10.0, window=60, long_window=300)
    assert s.prompt_tokens_rate == 400.0 and s.output_tokens_rate == 4.0
    assert s.handoff_seconds == 1.0
    assert s.ttft_within == 0.75 and s.tpot_within == 1.0
    prefill = _pool_reading(PREFILL, 1, Reading(1, s))
    assert prefill.token_rate == 400.0 and prefill.signals.attainment == 0.75
    assert prefill.tokens_per_request == 400.0 / s.arrival_rate
    decode = _pool_reading(DECODE, 1, Reading(1, s))
    assert decode.token_rate == 4.0 and decode.signals.attainment == 1.0


async def test_the_split_recommendation_follows_the_observed_mix_and_the_services_targets():
    """status.autoscaler.split: the split model on the committed profile, for the mean lengths observed,
    with targets of the class the service's own SLO is shaped like; recomputed only when the mix moves."""
    from goodput_contract.api.spec import parse
    from goodput_operator.autoscaling.pool_loop import PoolState, _split

    def service(ttft: str, tpot: str):
        return parse(
            "pd",
            "ns",
            {
                "model": {"source": "file:///models/tiny", "servedName": "tiny"},
                "slo": {"ttft": ttft, "tpot": tpot},
                "autoscaling": {"mode": "goodput", "minReplicas": 1, "maxReplicas": 4},
                "disaggregation": {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 4}},
            },
        )

    summariser, chat = service("15s", "150ms"), service("250ms", "100ms")  # DistServe's targets for each
    state = PoolState()
    assert await _split(state, None, summariser) is None  # nothing observed yet: nothing said
    long = await _split(state, (8000.0, 256.0), summariser)
    assert long["recommended"] == "disaggregated" and long["sloClass"] == "long-context"
    assert "CPU" in long["profile"]
    assert await _split(state, (8300.0, 250.0), summariser) is long  # within 20 %: not recomputed
    short = await _split(PoolState(), (200.0, 200.0), chat)
    assert short["recommended"] == "aggregated" and short["sloClass"] == "interactive"
