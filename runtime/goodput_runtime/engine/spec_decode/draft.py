"""A draft model proposes: a small model with the target's tokenizer, in the same process, with its
own paged KV cache (its own block manager, no prefix caching) and its own forward passes.

Each sequence has a shadow in the draft's cache. A proposal first brings the shadow up to the
sequence's tokens (rolling back what the target rejected, then computing what the draft has not
seen: the accepted tokens and the target's own), then takes k argmax steps, all sequences batched
in each. Proposals are the draft's argmax, so rejection sampling sees a one-hot proposal
distribution (see rejection.py).
"""

from __future__ import annotations

from collections import deque

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.engine.step import StepItem
from goodput_runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, k: int) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.k = k
        self.shadows: dict[tuple[str, int], Sequence] = {}
        # finished requests, dropped at the next proposal: forget() may run while a step proposes
        self.finished: deque[str] = deque()

    def forget(self, request_id: str) -> None:
        self.finished.append(request_id)

    def propose(self, requests: list[tuple[tuple[str, int], list[int]]]) -> list[list[int]]:
        while self.finished:
            request_id = self.finished.popleft()
            for key in [key for key in self.shadows if key[0] == request_id]:
                self.block_manager.free_seq(self.shadows.pop(key))
        drafts: list[list[int]] = [[] for _ in requests]
        live: list[int] = []  # requests whose shadow has room for this proposal
        for i, (key, tokens) in enumerate(requests):
            shadow = self._catch_up(key, tokens)
            if shadow is not None:
                live.append(i)
        for _ in range(self.k):
            if not live:
                break
            shadows = [self.shadows[requests[i][0]] for i in live]
            items = [
                StepItem(s.token_ids[s.num_computed_tokens :], s.num_computed_tokens, list(s.block_table), True)
                for s in shadows
            ]
            # the runner's step layout: single-token decodes first, longest context first (see plan_step)
            order = sorted(range(len(items)), key=lambda j: (len(items[j].token_ids) != 1, -items[j].context_len))
            ordered = self.runner.execute([items[j] for j in order]).argmax(dim=-1).tolist()
            best = [0] * len(items)
            for j, token in zip(order, ordered, strict=True):
                best[j] = token
            still: list[int] = []
            for i, shadow, token in zip(live, shadows, best, strict=True):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < self.k and self.block_manager.allocate(shadow, 1):
                    still.append(i)
            live = still
        return drafts

    def _catch_up(self, key: tuple[str, int], tokens: list[int]) -> Sequence | None:
        """The sequence's shadow holding `tokens`, with blocks for those it has not computed; None
        when the draft's cache has no room for them."""
        shadow = self.shadows.get(key)
        if shadow is None:
            shadow = self.shadows[key] = Sequence.new(key[0], [], GREEDY, 0.0, index=key[1])
        computed = shadow.token_ids[: shadow.num_computed_tokens]
        same = 0
        for mine, theirs in zip(computed, tokens, strict=False):
            if mine != theirs:
                break
            same += 1
        shadow.num_computed_tokens = min(same, len(tokens) - 1)  # what the target rejected is rolled back
        self.block_manager.trim(shadow)
        shadow.token_ids = list(tokens)
        if self.block_manager.allocate(shadow, shadow.num_uncomputed_tokens):
            return shadow
        self.block_manager.free_seq(self.shadows.pop(key))
        return None
