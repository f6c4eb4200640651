"""The KV cache event log (engine/kv_events.py): what a subscriber is sent converges on what is held,
whether it reads every change, merges them into events, or falls behind the backlog."""

from __future__ import annotations

import asyncio

from goodput_runtime.engine import kv_events
from goodput_runtime.engine.kv_events import KvEvents, batches, hex_digest


def apply(held: dict[str, set[str]], events: list[dict]) -> None:
    for event in events:
        target = held[event["tier"]]
        if event["type"] == "stored":
            target.update(event["blocks"])
        else:
            target.difference_update(event["blocks"])


def test_changes_merge_into_events_that_rebuild_what_is_held():
    log = KvEvents(block_size=4)
    start = log.snapshot()
    for d in range(1, 6):
        log.record("device", d, True)
    log.record("device", 2, False)
    log.record("offload", 2, True)
    log.record("device", 3, True)  # already held: no change, no sequence number
    changes = log.since(start["seq"])
    events = batches(changes)
    assert [(e["type"], e["tier"], e["first_seq"], e["seq"]) for e in events] == [
        ("stored", "device", 1, 5),
        ("removed", "device", 6, 6),
        ("stored", "offload", 7, 7),
    ]
    held = {tier: set(blocks) for tier, blocks in start["tiers"].items()}
    apply(held, events)
    assert held == {t: set(b) for t, b in log.snapshot()["tiers"].items()}
    assert held["device"] == {hex_digest(d) for d in (1, 3, 4, 5)}
    assert len(hex_digest(1)) == 32


def test_a_subscriber_behind_the_backlog_is_told_to_take_a_snapshot(monkeypatch):
    monkeypatch.setattr(kv_events, "BACKLOG", 4)
    log = KvEvents(block_size=4)
    for d in range(10):
        log.record("device", d, True)
    assert log.since(log.seq) == []
    assert [c.digest for c in log.since(log.seq - 2)] == [8, 9]
    assert log.since(2) is None  # changes 3.. are gone from the backlog
    assert log.since(log.seq + 5) is None  # a cursor from another instance


async def test_a_waiting_subscriber_wakes_on_a_change_from_another_thread():
    log = KvEvents(block_size=4)
    seq = log.seq
    waiter = asyncio.create_task(log.wait(seq, timeout=10))
    await asyncio.sleep(0.01)
    await asyncio.to_thread(log.record, "offload", 7, True)
    await asyncio.wait_for(waiter, 2)  # well before the 10 s timeout
    assert log.seq == seq + 1
