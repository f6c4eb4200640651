"""SLO-aware admission: answer 429 at once when a new request would wait past its TTFT target, or
would slow the running decodes past the TPOT target.

Under overload a FIFO queue grows until every request waits longer than its target: throughput
stays high while goodput (requests that met the SLO) falls to zero. Admission predicts a new
request's time to first token from what the engine holds now and refuses the request when the
prediction exceeds the target (less a safety margin), so the requests it serves keep meeting it.

The prediction, from the engine's own measurements:

- ``prefill``: the prompt tokens still to compute ahead of the request (waiting requests, running
  ones still in prefill) and its own, at the measured seconds per prompt token, plus the fixed
  cost of each step they take (a decode step's time);
- ``seat``: when the batch is full (``--max-num-seqs``), the time until enough running requests
  finish, from their remaining tokens at the measured decode step time;
- ``kv``: when the free KV blocks cannot hold the prompts ahead and its own, the time until the
  running requests holding enough blocks finish.

The request waits for the later of the seat and the KV, and for the prefill ahead of it, at the
step's whole token budget: under the SLO's scheduling (slo_schedule.py) prompts beside running
decodes go in smaller chunks, but those grow for a prompt that needs them to make its TTFT.

**TPOT.** Every request admitted decodes beside the others, and each decode step takes longer
with each sequence it carries (the step-time model of batch_cap.py, ``fixed + per_seq · n``).
Prompts share the same steps: if a share ``ρ`` of the engine's time goes to prompt tokens (measured
over the last ``PREFILL_WINDOW_S`` seconds), a decode's time per output token is about
``t(n) / (1 − ρ)``. A request is refused when that, with ``n`` the online requests running and
waiting plus its own choices, exceeds the TPOT target less the margin: past capacity the
requests already running keep their TPOT instead of every request missing it. ``t(n)`` is the
model's line only once decode steps of batch sizes ``MIN_FIT_SPREAD`` apart are timed; before
that, the mean of the steps timed. A line through sizes 1 to 3 read the noise of their averages as
the cost per sequence (3-35 ms where it is about 1): on SmolLM2 in bfloat16 at 1 req/s it predicted
90-130 ms for 20 sequences, and admission refused 4-6 requests in the first seconds of a run that
served every other request within the targets.

**A request's own targets.** A request may carry its own TTFT and TPOT targets (request_slo.py); it
is judged by them instead of ``--slo-ttft`` and ``--slo-tpot``: a tighter TTFT is refused sooner, a looser
one admitted past where the server's would refuse. The TPOT protected is the tightest of the newcomer's
and the online requests' running (each its own, else the server's): a loose newcomer does not slow a
tight request past its target. Where the engine keeps no step-time model (no ``--slo-tpot``), admission
fits its own from the steps it observes.

Until the engine has timed a decode step every request is admitted.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from goodput_runtime.engine.batch_cap import StepTimeModel
from goodput_runtime.engine.client import EngineClient
from goodput_runtime.engine.scheduler import ScheduledSeq, Scheduler
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.engine.slo_schedule import tightest_tpot
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import APIError

log = logging.getLogger(__name__)

EWMA_WEIGHT = 0.2  # share of the newest measurement in each running average
MIN_PREFILL_SAMPLE = 16  # prompt tokens a step needs to teach the cost per prompt token
LOG_EVERY_SECONDS = 10.0
PREDICTED_TTFT = "x-goodput-predicted-ttft"  # response headers: what admission predicted, seconds
PREDICTED_TPOT = "x-goodput-predicted-tpot"
PREFILL_WINDOW_S = 10.0  # the window the share of time spent on prompt tokens is measured over
MAX_PREFILL_SHARE = 0.95
MIN_FIT_SPREAD = 8  # batch sizes this far apart fit the step's cost per sequence (decode_step_seconds)


@dataclass(frozen=True)
class AdmissionSettings:
    ttft_target: float | None  # seconds; None: TPOT only
    margin: float = 0.1  # a request is refused when its prediction exceeds target × (1 − margin)
    tpot_target: float | None = None  # seconds; None: TTFT only

    @property
    def limit(self) -> float:
        return math.inf if self.ttft_target is None else self.ttft_target * (1.0 - self.margin)

    @property
    def tpot_limit(self) -> float:
        return math.inf if self.tpot_target is None else self.tpot_target * (1.0 - self.margin)


class StepRates:
    """Running averages of what the engine measured: seconds per prefill token, seconds per decode
    step, and how many tokens a finished request generated."""

    def __init__(self) -> None:
        self.prefill_token_seconds: float | None = None
        self.decode_step_seconds: float | None = None
        self.output_tokens: float | None = None

    @staticmethod
    def _blend(old: float | None, new: float) -> float:
        return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new

    def observe_step(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        if prefill_tokens == 0:
            if decode_seqs:
                self.decode_step_seconds = self._blend(self.decode_step_seconds, seconds)
            return
        if self.decode_step_seconds is None or prefill_tokens < MIN_PREFILL_SAMPLE:
            return  # a few prompt tokens tell the step's fixed cost, not the cost per token
        # a step costs what a decode step costs (its fixed part) plus its prompt tokens
        per_token = max(seconds - self.decode_step_seconds, seconds * 0.1) / prefill_tokens
        self.prefill_token_seconds = self._blend(self.prefill_token_seconds, per_token)

    def observe_finished(self, num_output_tokens: int) -> None:
        self.output_tokens = self._blend(self.output_tokens, float(num_output_tokens))

    @property
    def measured(self) -> bool:
        """Once a decode step is timed; until a long enough prefill is, prompt tokens count as free
        and each step as a decode step."""
        return self.decode_step_seconds is not None


class PrefillShare:
    """The share of the engine's wall time that went to prompt tokens over the last window: each
    step's time beyond the decode step of its size (the step-time model's), summed."""

    def __init__(self, window_s: float = PREFILL_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()  # (when, seconds of prompt work)
        self.total = 0.0

    def observe(self, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if seconds > 0:
            self.samples.append((now, seconds))
            self.total += seconds
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.total -= self.samples.popleft()[1]

    def share(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.observe(0.0, now)
        # over the whole window, even just after start: an idle start does not read as prompt-bound
        return min(max(self.total, 0.0) / self.window_s, MAX_PREFILL_SHARE)


@dataclass(frozen=True)
class Prediction:
    ttft: float  # seconds
    prefill: float
    seat: float
    kv: float


def predict_tpot(
    scheduler: Scheduler, share: PrefillShare, n: int, fallback: StepTimeModel | None = None
) -> float | None:
    """The running decodes' time per output token once a request of `n` choices has joined the
    online ones running and waiting; None until decode steps of the step-time model (the engine's,
    else `fallback`) are timed."""
    model = step_model(scheduler) or fallback
    if model is None or not model.measured:
        return None
    online = sum(1 for s in scheduler.running if s.params.priority <= 0)
    if not online:  # nothing decodes to protect, and only running steps keep the model current
        return None
    online += sum(1 + len(s.forks) for s in scheduler.waiting if s.params.priority <= 0)
    decodes = min(online + n, scheduler.max_num_seqs)
    return decode_step_seconds(model, decodes) / (1.0 - share.share())


def decode_step_seconds(model: StepTimeModel, decodes: int) -> float:
    """A decode step of `decodes` sequences as admission predicts it: the model's line once it is
    fitted through batch sizes at least MIN_FIT_SPREAD apart; before that the steps' mean time. A line
    through nearby sizes (1 to 3 sequences, say) takes the noise of their averages for the cost per
    sequence and, carried out to a full batch, predicts several times the true step: it would refuse
    requests at a fraction of the load the server serves within its targets."""
    if model.size_spread < MIN_FIT_SPREAD:
        return model.mean_decode_seconds()
    return model.decode_seconds(decodes)


def running_tpot_target(scheduler: Scheduler, default: float | None) -> float | None:
    """The tightest TPOT target among the online requests running: each its own, else `default`."""
    return tightest_tpot(scheduler.running, default)


def step_model(scheduler: Scheduler) -> StepTimeModel | None:
    if scheduler.slo is not None:
        return scheduler.slo.model
    return scheduler.batch_cap.model if scheduler.batch_cap is not None else None


def observe_step(rates: StepRates, scheduled: list[ScheduledSeq], seconds: float) -> None:
    """Feed one executed step (the scheduler's ScheduledSeq list, after update) into `rates`."""
    prefill = decodes = 0
    for item in scheduled:
        seq = item.seq
        if item.num_tokens == 1 and seq.num_computed_tokens > seq.num_prompt_tokens:
            decodes += 1
        else:
            prefill += item.num_tokens
        if seq.is_finished and seq.pooling is None:
            rates.observe_finished(seq.num_output_tokens)
    rates.observe_step(prefill, decodes, seconds)


def remaining_tokens(seq: Sequence, typical: float | None) -> int:
    """Tokens a running sequence has yet to generate: up to its max_tokens, expected near the typical
    output length (once measured) for requests that stop on their own."""
    left = max(1, seq.params.max_tokens - seq.num_output_tokens)
    if typical is not None and not seq.params.ignore_eos:
        left = min(left, max(1, math.ceil(typical) - seq.num_output_tokens))
    return left


def predict(
    scheduler: Scheduler, rates: StepRates, num_prompt_tokens: int, n: int, priority: int = 0
) -> Prediction | None:
    """The predicted TTFT of a request arriving now; None until a decode step is measured. Waiting
    requests of a later priority class (batch work behind an online request) are not ahead of it."""
    if not rates.measured:
        return None
    prefill_s, step_s = rates.prefill_token_seconds or 0.0, rates.decode_step_seconds or 0.0
    running = scheduler.running
    waiting = [s for s in scheduler.waiting if s.params.priority <= priority]
    block_manager = scheduler.block_manager
    # prefill ahead of the request, and its own, sharing each step with the running decodes
    in_prefill = [s for s in running if s.num_computed_tokens < s.num_prompt_tokens]
    # a batch prefill under way is not ahead of an online request either: it pauses for it
    ahead = sum(s.num_uncomputed_tokens for s in waiting) + sum(
        s.num_uncomputed_tokens for s in in_prefill if s.params.priority <= priority
    )
    tokens = ahead + num_prompt_tokens
    decoding = len(running) - len(in_prefill)
    # the whole budget, even under the SLO's scheduling: its chunks grow for a prompt that needs it
    # to make its TTFT (slo_schedule.py), so the TPOT check below is what counts the cost to decodes
    budget = max(1, scheduler.max_num_batched_tokens - decoding)
    prefill = tokens * prefill_s + math.ceil(tokens / budget) * step_s

    finishing = sorted((remaining_tokens(s, rates.output_tokens), len(s.block_table)) for s in running)
    typical_tokens = rates.output_tokens or (finishing[-1][0] if finishing else 1.0)
    seats_taken = len(running) + sum(1 + len(s.forks) for s in waiting) + n
    seat = wait_for_finishes(
        finishing, seats_taken - scheduler.max_num_seqs, scheduler.max_num_seqs, typical_tokens, step_s
    )
    blocks_needed = block_manager.blocks_needed(tokens + 1)
    kv = 0.0
    deficit = blocks_needed - block_manager.num_free_blocks
    if deficit > 0:
        freed, kv = 0, math.inf
        for left, blocks in finishing:
            freed += blocks
            if freed >= deficit:
                kv = left * step_s
                break
    return Prediction(max(seat, kv) + prefill, prefill, seat, kv)


def wait_for_finishes(
    finishing: list[tuple[int, int]], count: int, max_num_seqs: int, typical_tokens: float, step_s: float
) -> float:
    """Seconds until `count` more requests have finished: the running ones first (shortest remaining
    first), then later ones at the batch's steady rate, a full batch per typical request."""
    if count <= 0:
        return 0.0
    if count <= len(finishing):
        return finishing[count - 1][0] * step_s
    last = finishing[-1][0] if finishing else 0
    rounds = (count - len(finishing)) / max(1, max_num_seqs)
    return (last + rounds * typical_tokens) * step_s


class Admission:
    """Refuses, with 429 and Retry-After, the requests predicted to miss the TTFT target or to push
    the running decodes past the TPOT target."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self.rates = StepRates()
        self.prefill_share = PrefillShare()
        self.own_model = StepTimeModel()  # fitted here where the engine keeps no step-time model
        self._refused_since_log = 0
        self._last_log = 0.0

    def attach(self, engine: EngineClient) -> None:
        """Measure every step the engine runs from now on."""
        engine.step_observers.append(lambda scheduled, seconds: self._observe(engine, scheduled, seconds))

    def _observe(self, engine: EngineClient, scheduled: list[ScheduledSeq], seconds: float) -> None:
        observe_step(self.rates, scheduled, seconds)
        decodes = sum(
            1
            for item in scheduled
            if item.num_tokens - len(item.draft) == 1 and item.seq.num_computed_tokens > item.seq.num_prompt_tokens
        )
        model = step_model(engine.scheduler)
        if model is None:
            model = self.own_model
            model.observe(decodes, sum(i.num_tokens for i in scheduled) - decodes, seconds)
        if not model.measured:
            return
        if len(scheduled) > decodes:  # some prompt work this step
            self.prefill_share.observe(max(seconds - model.decode_seconds(decodes), 0.0))

    def check(self, engine: EngineClient, num_prompt_tokens: int, params: SamplingParams) -> dict[str, str]:
        """Refuse the request (APIError 429), or admit it: then the predictions it was admitted on,
        as response headers (``PREDICTED_TTFT``, ``PREDICTED_TPOT``: seconds), so a client or a
        benchmark can hold them against what it measures."""
        if params.priority > 0:
            return {}  # batch work has no TTFT target: it waits behind online requests, paced by the gateway
        keep = 1.0 - self.settings.margin
        ttft_target = self.settings.ttft_target if params.slo_ttft is None else params.slo_ttft
        tpot_target = self.settings.tpot_target if params.slo_tpot is None else params.slo_tpot
        running = running_tpot_target(engine.scheduler, self.settings.tpot_target)
        if running is not None and (tpot_target is None or running < tpot_target):
            tpot_target = running
        headers = {}
        tpot = predict_tpot(engine.scheduler, self.prefill_share, params.n, self.own_model)
        if tpot is not None:
            if tpot_target is not None and tpot > tpot_target * keep:
                self._refuse_tpot(tpot, tpot_target)
            headers[PREDICTED_TPOT] = f"{tpot:.4f}"
        if ttft_target is None:
            return headers
        prediction = predict(engine.scheduler, self.rates, num_prompt_tokens, params.n, params.priority)
        if prediction is None:
            return headers
        limit = ttft_target * keep
        if prediction.ttft <= limit:
            headers[PREDICTED_TTFT] = f"{prediction.ttft:.4f}"
            return headers
        self._log_refusal(prediction, ttft_target)
        over = prediction.ttft - limit
        retry_after = max(1, math.ceil(min(over, 60.0)))
        raise APIError(
            429,
            f"The server is overloaded: this request's predicted time to first token "
            f"({prediction.ttft:.2f}s) exceeds the {ttft_target:g}s target; retry later",
            "rate_limit_error",
            code="slo_unattainable",
            headers={"Retry-After": str(retry_after)},
        )

    def _refused(self) -> int | None:
        """Count a refusal; the refusals since the last warning when one is due (every
        LOG_EVERY_SECONDS at most), else None."""
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_SECONDS:
            return None
        count, self._refused_since_log, self._last_log = self._refused_since_log, 0, now
        return count

    def _refuse_tpot(self, tpot: float, target: float) -> None:
        count = self._refused()
        if count is not None:
            log.warning(
                "Overloaded: refused %d requests; the latest would take the running decodes to %.0f ms a token "
                "against the %g ms TPOT target (prompt work %.0f%% of the time)",
                count,
                tpot * 1e3,
                target * 1e3,
                100 * self.prefill_share.share(),
            )
        raise APIError(
            429,
            f"The server is overloaded: another request now would take the running requests' time per "
            f"output token to {tpot * 1e3:.0f} ms, past the {target * 1e3:g} ms target; "
            "retry later",
            "rate_limit_error",
            code="tpot_unattainable",
            headers={"Retry-After": "1"},
        )

    def _log_refusal(self, prediction: Prediction, target: float) -> None:
        count = self._refused()
        if count is not None:
            log.warning(
                "Overloaded: refused %d requests predicted to miss the %gs TTFT target (latest %.2fs: "
                "prefill %.2fs, seat %.2fs, KV %.2fs)",
                count,
                target,
                prediction.ttft,
                prediction.prefill,
                prediction.seat,
                prediction.kv,
            )
