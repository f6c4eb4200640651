"""How a step runs on a CPU: its threads, and the form of the matrix products of its projections.

Four forms of each projection ``x @ W^T`` (the compact modules' ``project`` runs them):

- ``linear``: ``F.linear(x, W)``, torch's default (MKL's GEMM on x86).
- ``transposed``: the same product as ``W @ x^T``. On the project's AMD machine MKL takes a slow
  small-matrix path for ``F.linear`` with 2 to 8 rows (SmolLM2's projections and LM head: 76 ms
  for 2 rows against 44 for one); the transposed product runs 2 rows in 28 ms.
- ``onednn``: oneDNN's matmul over a copy of the weight reordered once into its blocked layout
  (``mkldnn._reorder_linear_weight``), what inductor's CPU freezing and vLLM's CPU backend use.
  Measured there with two threads: one row 24 ms against 43, 16 rows 32 against 68, 64 rows 90
  against 136, 512 rows 676 against 784. It costs a second copy of each weight it covers.

The four compute the same sums in different orders, so outputs agree to float rounding. Which one a
step of a given size takes, and with how many threads, is a ``StepPlan``: timed at start-up by the
engine's step tuning (engine/step_tuning.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

LINEAR, TRANSPOSED, ONEDNN, NATIVE = "linear", "transposed", "onednn", "native"
FORMS = (LINEAR, TRANSPOSED, ONEDNN, NATIVE)
SHOWN = {LINEAR: "F.linear", TRANSPOSED: "W@x^T", ONEDNN: "oneDNN", NATIVE: "native"}


@dataclass(frozen=True)
class StepPlan:
    """How a step of a given number of tokens runs: its threads, and the form of the decoder layers'
    projections and of the LM head (one of FORMS). The layers go by the step's token count, the LM
    head by the rows it keeps. Counts past `limit`, and every count when `counts` is empty, run with
    `pool` threads and the `large` form."""

    pool: int
    counts: tuple[int, ...] = ()
    threads: tuple[int, ...] = ()
    layer_forms: tuple[str, ...] = ()
    head_forms: tuple[str, ...] = ()
    limit: int = 0  # the counts cover steps of up to this many tokens
    large: str = LINEAR

    def _at(self, tokens: int) -> int | None:
        if not self.counts or tokens > self.limit or tokens < self.counts[0]:
            return None
        return bisect.bisect_right(self.counts, tokens) - 1

    def threads_for(self, tokens: int) -> int:
        i = self._at(tokens)
        return self.pool if i is None else self.threads[i]

    def layer_form(self, tokens: int) -> str:
        i = self._at(tokens)
        return self.large if i is None else self.layer_forms[i]

    def head_form(self, rows: int) -> str:
        i = self._at(rows)
        return self.large if i is None else self.head_forms[i]

    def uses(self, form: str) -> bool:
        return form == self.large or form in self.layer_forms or form in self.head_forms

    def only(self, form: str) -> bool:
        return {self.large, *self.layer_forms, *self.head_forms} == {form}

    @classmethod
    def default(cls, pool: int) -> StepPlan:
        """Untimed: the LM head transposed for 2 to 8 rows (a verification step's; measured on SmolLM2
        6-9 ms against 17-25 ms for F.linear), everything else as the library does it."""
        return cls(pool, (1, 2), (pool, pool), (LINEAR, LINEAR), (LINEAR, TRANSPOSED), limit=8)

    @classmethod
    def uniform(cls, threads: int, form: str, limit: int) -> StepPlan:
        """One choice for every step (up to `limit` tokens; larger ones in the same form): what tuning times."""
        return cls(threads, (1,), (threads,), (form,), (form,), limit=limit, large=form)

    def describe(self) -> str:
        parts = []
        for i, count in enumerate(self.counts):
            end = self.counts[i + 1] - 1 if i + 1 < len(self.counts) else self.limit
            span = str(count) if end == count else f"{count}-{end}"
            form = SHOWN[self.layer_forms[i]]
            if self.head_forms[i] != self.layer_forms[i]:
                form += f" (LM head {SHOWN[self.head_forms[i]]})"
            parts.append(f"{span}: {self.threads[i]} thread{'s' if self.threads[i] > 1 else ''}, {form}")
        return "; ".join([*parts, f"larger steps {self.pool} threads, {SHOWN[self.large]}"])
