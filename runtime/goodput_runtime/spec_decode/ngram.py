"""Prompt lookup: match the last n tokens of a request against its own prompt and output, and
propose the tokens that followed the latest earlier occurrence. Pure Python, no model."""

from __future__ import annotations

from collections.abc import Sequence as Tokens


def propose_ngram(tokens: Tokens[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of n tokens
    (n_max down to n_min) found earlier in tokens; empty when none is."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n :])
        first = suffix[0]
        # latest start i < size - n whose n tokens equal the suffix
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : min(i + n + k, size)])
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, requests: list[tuple[tuple[str, int], list[int]]]) -> list[list[int]]:
        """Proposals for each (sequence key, its tokens so far)."""
        return [propose_ngram(tokens, self.k, self.n_min, self.n_max) for _, tokens in requests]

    def forget(self, request_id: str) -> None:
        pass
