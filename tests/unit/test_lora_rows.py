"""A step's rows ordered by adapter (step_inputs.lora_order): each padded decode group stays the same
group, its rows by adapter; prompt chunks by adapter after the decodes; one run of rows per adapter
where the groups allow it, so each adapter's product runs once per run (layers/lora.py)."""

from __future__ import annotations

import torch

from goodput_runtime.engine.step import StepItem
from goodput_runtime.engine.step_inputs import decode_spans, lora_batch, lora_order


def decode(context: int, slot: int) -> StepItem:
    return StepItem([7], context - 1, [0] * 64, True, lora_slot=slot)


def prompt(tokens: int, slot: int) -> StepItem:
    return StepItem([7] * tokens, 0, [0] * 64, True, lora_slot=slot)


def rows_of(items: list[StepItem]) -> list[tuple[int, int, int]]:
    """(slot, first row, row count) per item, in order."""
    out, row = [], 0
    for item in items:
        out.append((item.lora_slot, row, len(item.token_ids)))
        row += len(item.token_ids)
    return out


def test_four_adapters_interleaved_become_one_run_each():
    items = [decode(300, 1 + i % 4) for i in range(16)]
    order = lora_order(items, one_decode_group=False)
    assert order is not None
    run = [items[i] for i in order]
    assert [item.lora_slot for item in run] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    batch = lora_batch(run, [r for _, r, _ in rows_of(run)], torch.device("cpu"))
    assert batch is not None and batch.groups == [(s, slice(4 * (s - 1), 4 * s)) for s in (1, 2, 3, 4)]


def test_decode_groups_stay_the_same_and_prompts_follow_by_adapter():
    contexts = [400, 390, 380, 350, 200, 190, 180, 60, 50]  # longest first, as plan_step orders them
    slots = [2, 1, 2, 1, 0, 3, 0, 1, 2]
    items = [decode(c, s) for c, s in zip(contexts, slots, strict=True)] + [prompt(5, 3), prompt(9, 1), prompt(4, 3)]
    order = lora_order(items, one_decode_group=False)
    assert order is not None and sorted(order) == list(range(len(items)))
    run = [items[i] for i in order]
    before = decode_spans(contexts, False)
    assert decode_spans([item.context_len for item in run[:9]], False) == before == [(0, 4), (4, 7), (7, 9)]
    for first, last in before:  # the same rows in each group, the longest first, the rest by adapter
        assert {id(item) for item in run[first:last]} == {id(item) for item in items[first:last]}
        assert run[first] is items[first]
    assert [item.lora_slot for item in run[:9]] == [2, 2, 1, 1, 0, 0, 3, 1, 2]
    assert [(item.lora_slot, len(item.token_ids)) for item in run[9:]] == [(1, 9), (3, 5), (3, 4)]
    # with one decode group (the GPU kernel) every decode is one group: one run per adapter
    one = lora_order(items, one_decode_group=True)
    assert one is not None
    assert [items[i].lora_slot for i in one[:9]] == [2, 2, 2, 0, 0, 1, 1, 1, 3]


def test_a_step_without_adapters_or_already_ordered_is_left_as_it_is():
    assert lora_order([decode(100, 0), decode(90, 0), prompt(4, 0)], False) is None
    assert lora_order([decode(100, 1), decode(90, 1), decode(80, 2), prompt(4, 0), prompt(4, 3)], False) is None
