"""Prompt lookup: match the last n tokens of a request against its own prompt and output, and
propose the tokens that followed the latest earlier occurrence. Pure Python, no model.

How many of those tokens to propose is chosen per proposal when the cost of a verification is
known (``step_costs``: what a step of 1, 2, ... k + 1 tokens per sequence costs, timed at
start-up): the length that yields the most tokens per unit of step time, given the acceptance
rate the sequence has had so far from matches of that many tokens. A one-token match in free text is mostly
wrong (about one proposal in six kept on SmolLM2 rewriting a passage), a four-token one mostly
right (nine in ten), so weak matches propose little or nothing and strong ones the full k; and
on a CPU, where a step of 2 or 3 tokens can cost more than one of 4 (small matrix products take
a slow path), those lengths are never picked.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens

# the acceptance rate assumed before anything is learned, as pseudo-counts (accepted, rejected)
PRIOR = (1.0, 1.0)
# each observation scales the counts of its match length by this first: the estimate follows the
# sequence's recent proposals (about the last 50 of each match length)
DECAY = 0.98


def find_ngram(tokens: Tokens[int], n_min: int = 1, n_max: int = 4) -> tuple[int, int]:
    """(n, where its continuation starts) for the longest suffix of n tokens (n_max down to n_min)
    found earlier in tokens, at its latest earlier occurrence; (0, 0) when none is."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n :])
        first = suffix[0]
        # latest start i < size - n whose n tokens equal the suffix
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                return n, i + n
    return 0, 0


def propose_ngram(tokens: Tokens[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of n tokens
    (n_max down to n_min) found earlier in tokens; empty when none is."""
    n, start = find_ngram(tokens, n_min, n_max)
    return list(tokens[start : min(start + k, len(tokens))]) if n else []


def expected_yield(acceptance: float, length: int) -> float:
    """Tokens a verification of `length` proposals yields when each is kept with probability
    `acceptance` until the first rejection: the kept ones and the target's own."""
    return float(length + 1) if acceptance >= 1.0 else (1.0 - acceptance ** (length + 1)) / (1.0 - acceptance)


def best_length(acceptance: float, costs: Tokens[float], k: int) -> int:
    """The proposal length (0..k) with the most expected tokens per step cost; costs[t - 1] is the
    cost of a step of t tokens per sequence (t = 1..k + 1). The shorter one on a tie."""
    best, best_rate = 0, 1.0 / costs[0]
    for length in range(1, min(k, len(costs) - 1) + 1):
        rate = expected_yield(acceptance, length) / costs[length]
        if rate > best_rate * 1.0001:
            best, best_rate = length, rate
    return best


class NgramProposer:
    """Prompt lookup for every speculating sequence. With `step_costs` (see the module's doc) the
    proposal length adapts to the acceptance rate learned per match length; without, every match
    proposes up to k tokens."""

    def __init__(self, k: int, n_min: int, n_max: int, step_costs: Tokens[float] | None = None) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.step_costs = list(step_costs) if step_costs else None
        # per sequence: per match length, (accepted, rejected) proposal tokens, decayed: what acceptance()
        # estimates from. Per sequence, so that a seeded request draws the same whatever ran before it
        self.counts: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
        # per sequence: (its length, match length, the k tokens the lookup found) at its last proposal,
        # compared with the tokens it got to learn from (whether or not they were proposed and verified)
        self.pending: dict[tuple[str, int], tuple[int, int, list[int]]] = {}

    def acceptance(self, key: tuple[str, int], n: int) -> float:
        accepted, rejected = self.counts.get(key, {}).get(n, (0.0, 0.0))
        return (accepted + PRIOR[0]) / (accepted + rejected + PRIOR[0] + PRIOR[1])

    def propose(self, requests: list[tuple[tuple[str, int], list[int]]]) -> list[list[int]]:
        """Proposals for each (sequence key, its tokens so far)."""
        proposals: list[list[int]] = []
        for key, tokens in requests:
            self._learn(key, tokens)
            n, start = find_ngram(tokens, self.n_min, self.n_max)
            if not n:
                proposals.append([])
                continue
            found = tokens[start : start + self.k]
            if self.step_costs is None:
                proposals.append(found)
                continue
            self.pending[key] = (len(tokens), n, found)
            proposals.append(found[: best_length(self.acceptance(key, n), self.step_costs, len(found))])
        return proposals

    def _learn(self, key: tuple[str, int], tokens: list[int]) -> None:
        """Fold how many of the tokens the lookup found last time came true into its match length's counts."""
        last = self.pending.pop(key, None)
        if last is None:
            return
        size, n, found = last
        got = tokens[size:]
        kept = 0
        while kept < len(got) and kept < len(found) and got[kept] == found[kept]:
            kept += 1
        rejected = 1.0 if kept < len(got) and kept < len(found) else 0.0
        counts = self.counts.setdefault(key, {})
        accepted, rejections = counts.get(n, (0.0, 0.0))
        counts[n] = (accepted * DECAY + kept, rejections * DECAY + rejected)

    def forget(self, request_id: str) -> None:
        for key in [key for key in self.counts if key[0] == request_id]:
            del self.counts[key]
        for key in [key for key in self.pending if key[0] == request_id]:
            del self.pending[key]
