"""The LoRA manager's slots and CPU tier, and the prefix digest: a slot is reused least recently used
first among adapters no running sequence uses, pinned adapters last; the CPU tier drops the least
recent unpinned adapter; the prefix digest is the same in another process and differs per adapter."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.lora_manager import LoraAdapter, LoraManager, LoraNotFound, ModelShape
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.layers import lora
from goodput_runtime.layers.lora import LoraBatch, LoraStack
from goodput_runtime.sampling import SamplingParams

SHAPE = ModelShape(1, {"q_proj": (4, 4)}, "base")


def adapter(name: str, value: float, pinned: bool = False) -> LoraAdapter:
    weights = {(0, "q_proj"): (torch.full((2, 4), value), torch.ones(4, 2))}
    return LoraAdapter(
        name, f"/adapters/{name}", 2, 1.0, f"digest-{name}-{value}", None, ("q_proj",), weights, 64, pinned
    )


def manager(slots: int = 2, cpu: int = 8) -> tuple[LoraManager, LoraStack]:
    stack = LoraStack(slots + 1, 4, [4], 2, torch.float32, torch.device("cpu"))
    return LoraManager({(0, "q_proj"): (stack, 0)}, SHAPE, slots, cpu, 2), stack


def test_slots_are_reused_lru_among_idle_adapters_and_pinned_last():
    m, stack = manager()
    a, b, c = (m.add(adapter(n, v)) for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    assert m.acquire(a.key, set()) == 1 and m.acquire(b.key, set()) == 2
    assert stack.a[0, 1, 0] == 1.0 and stack.a[0, 2, 0] == 2.0 and not stack.a[:, 0].any()  # slot 0: the base
    # both busy: no slot for c
    assert m.acquire(c.key, {a.key, b.key}) is None
    # a idle: c takes a's slot, and a's weights there are replaced
    assert m.acquire(c.key, {b.key}) == 1 and stack.a[0, 1, 0] == 3.0
    assert m.slot_of(c.key) == 1 and a.key not in m.slots
    # the least recently used idle slot goes first: c is touched again, so a new adapter takes b's
    m.acquire(c.key, set())
    d = m.add(adapter("d", 4.0))
    assert m.acquire(d.key, set()) == 2 and b.key not in m.slots


def test_a_pinned_adapters_slot_goes_last():
    m, _ = manager()
    pinned = m.add(adapter("p", 1.0), pinned=True)
    other = m.add(adapter("o", 2.0))
    m.acquire(pinned.key, set())  # used first: least recent
    m.acquire(other.key, set())
    new = m.add(adapter("n", 3.0))
    m.acquire(new.key, set())
    assert pinned.key in m.slots and other.key not in m.slots


def test_cpu_tier_drops_the_least_recent_unpinned_and_reads_it_again_from_disk():
    m, _ = manager(slots=1, cpu=2)
    m.add(adapter("p", 1.0), pinned=True)
    b = m.add(adapter("b", 2.0))
    c = m.add(adapter("c", 3.0))
    assert b.weights is None and c.weights is not None and b.key not in m.cpu  # b dropped, p pinned stays
    assert m.resident() == (0, 2)
    # b's weights come back from its directory when it needs a slot
    read = []
    m.read = lambda name, path: (read.append(name), adapter("b", 2.0))[1]  # type: ignore[method-assign]
    assert m.acquire(b.key, set()) == 1 and read == ["b"]


def test_an_unloaded_adapter_is_gone_unless_a_slot_still_holds_it():
    m, _ = manager()
    a = m.add(adapter("a", 1.0))
    m.acquire(a.key, set())
    assert m.remove("a") and not m.remove("a")
    with pytest.raises(LoraNotFound):
        m.get("a")
    assert m.acquire(a.key, {a.key}) == 1  # its running sequences keep their slot
    b = m.add(adapter("b", 2.0))
    m.acquire(b.key, set())
    c = m.add(adapter("c", 3.0))
    m.acquire(c.key, set())  # a's slot reused: a is gone for good
    with pytest.raises(LoraNotFound):
        m.acquire(a.key, set())


SPANS = [(0, 0, 1), (2, 1, 1), (1, 2, 1), (1, 3, 5), (0, 8, 3), (1, 11, 2)]
SCATTERED = [(1, 0, 1), (2, 1, 1), (1, 2, 1), (2, 3, 1), (1, 4, 1), (0, 5, 3), (1, 8, 2)]


@pytest.mark.parametrize("path", lora.DECODE_PATHS)
@pytest.mark.parametrize("spans", [SPANS, SCATTERED], ids=["runs", "scattered"])
def test_every_decode_path_adds_each_rows_own_adapter(path, spans, monkeypatch):
    monkeypatch.setattr(lora, "DECODE_PATH", path)
    batch = LoraBatch.of(spans, torch.device("cpu"))
    if path != "grouped" and spans is SPANS:
        assert batch.decode_rows.tolist() == [1, 2] and batch.decode_slots.tolist() == [2, 1]
        assert batch.groups == [(1, slice(3, 8)), (1, slice(11, 13))]
    if path == "grouped" and spans is SPANS:  # adjacent rows of one adapter are one run: a product pair each
        assert batch.groups == [(2, slice(1, 2)), (1, slice(2, 8)), (1, slice(11, 13))]
    if path == "grouped" and spans is SCATTERED:  # slot 1 in four runs: gathered into one product
        (slot, rows), *rest = batch.groups
        assert slot == 1 and rows.tolist() == [0, 2, 4, 8, 9] and rest == [(2, slice(1, 2)), (2, slice(3, 4))]
    stack = LoraStack(3, 4, [3, 2], 2, torch.float32, torch.device("cpu"))
    weights = {slot: (torch.randn(2, 4), torch.randn(2, 2)) for slot in (1, 2)}
    for slot, (a, b) in weights.items():
        stack.set(slot, 1, a, b, 0.5)
    x = torch.randn(13, 4)
    y = torch.zeros(13, 5)
    stack.add_(y, x, batch)
    want = torch.zeros(13, 5)
    for slot, first, count in spans:
        if slot:
            a, b = weights[slot]
            for row in range(first, first + count):
                want[row, 3:] = 0.5 * (x[row] @ a.t() @ b.t())
    torch.testing.assert_close(y, want)


def test_prefix_digests_are_equal_across_processes_and_differ_by_model_and_adapter():
    tokens = tuple(range(16))
    here = prefix_digest.block_digest(prefix_digest.root("model=m"), tokens)
    code = (
        "from goodput_runtime.engine import prefix_digest as p;"
        "print(p.block_digest(p.root('model=m'), tuple(range(16))))"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(there) == here
    assert prefix_digest.block_digest(prefix_digest.root("model=n"), tokens) != here
    assert len(prefix_digest.to_bytes(here)) == 16

    bm = BlockManager(8, 4, True, "model=m")
    base = Sequence.new("a", list(range(9)), SamplingParams(), 0.0)
    lora = Sequence.new("b", list(range(9)), SamplingParams(lora="x"), 0.0)
    lora.cache_salt = prefix_digest.adapter_salt("x", "d1")
    for seq in (base, lora):
        assert bm.allocate(seq, 9, bm.match_prefix(seq))
        seq.num_computed_tokens = 9
        bm.commit(seq)
    assert not set(base.block_hashes) & set(lora.block_hashes)
    again = Sequence.new("c", list(range(9)), SamplingParams(lora="x"), 0.0)
    again.cache_salt = lora.cache_salt
    assert bm.match_prefix(again) == lora.block_table[:2]
    reloaded = Sequence.new("d", list(range(9)), SamplingParams(lora="x"), 0.0)
    reloaded.cache_salt = prefix_digest.adapter_salt("x", "d2")
    assert bm.match_prefix(reloaded) == []


def test_a_request_passed_over_for_a_slot_is_not_starved_by_a_busy_adapters_newcomers():
    import time

    from goodput_runtime.engine.scheduler import LORA_AGEING_S, Scheduler

    m, _ = manager(slots=1)
    hot, cold = m.add(adapter("hot", 1.0)), m.add(adapter("cold", 2.0))
    scheduler = Scheduler(BlockManager(64, 4, True, "m"), 8, 64, 64)
    scheduler.lora = m

    def seq(name: str, key: str, arrival: float) -> Sequence:
        s = Sequence.new(name, [1, 2, 3], SamplingParams(max_tokens=50, lora=key), arrival)
        s.cache_salt = key
        scheduler.add(s)
        return s

    now = time.monotonic()
    seq("hot-1", hot.key, now)
    scheduler.schedule()  # hot takes the one slot
    waiting_cold = seq("cold-1", cold.key, now)
    seq("hot-2", hot.key, now)
    out = scheduler.schedule()
    assert {s.seq.request_id for s in out.scheduled} == {"hot-1", "hot-2"}  # cold passed over, hot's newcomer in
    waiting_cold.times.arrival = now - LORA_AGEING_S - 1  # cold has waited past the ageing limit
    seq("hot-3", hot.key, now)
    seq("base", "", now)
    out = scheduler.schedule()
    assert "hot-3" not in {s.seq.request_id for s in out.scheduled}  # the slot drains to cold
    assert "base" in {s.seq.request_id for s in out.scheduled}  # the base model is not held up
    for s in list(scheduler.running):
        if s.cache_salt == hot.key:
            scheduler.finish(s, "stop")
    out = scheduler.schedule()
    assert "cold-1" in {s.seq.request_id for s in out.scheduled} and m.slot_of(cold.key) == 1
