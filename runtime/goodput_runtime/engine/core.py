"""One engine step in three phases: schedule → execute → update.

Synchronous. `step()` runs the three in a row; the async engine calls the same phases itself so
that `execute`, the forward pass, runs on its worker thread while the event loop stays free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.detokenizer import IncrementalDetokenizer
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.outputs import InvalidPromptError, PromptTooLongError, RequestOutput
from goodput_runtime.engine.parallel import Followers
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

WARMUP_REQUEST_ID = "warmup"


@dataclass
class Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, max_model_len: int,
                 metrics: RuntimeMetrics | None = None, followers: Followers | None = None) -> None:
        self.runner = runner
        self.followers = followers  # the other tensor-parallel ranks, when there are any
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; with at least one generated token it "
                f"exceeds the maximum model length of {self.max_model_len} tokens"
            )
        if not prompt_token_ids:
            raise InvalidPromptError("the prompt is empty")
        seq = Sequence.new(request_id, prompt_token_ids, params, time.monotonic())
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        self.requests[request_id] = Request(seq, detokenizer)
        self.scheduler.add(seq)

    def close(self) -> None:
        if self.followers is not None:
            self.followers.stop()
            self.followers = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        out = self.schedule()
        if not out.scheduled:
            return []
        return self.update(out, self.execute(out))

    def schedule(self) -> SchedulerOutput:
        """Phase 1: which sequences run this step, and how many tokens each."""
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Phase 2, the forward pass: the sampled token per scheduled sequence (None mid-prefill).
        Touches only the runner's tensors, so it may run on another thread than the other phases."""
        return self.runner.run(out)

    def warmup(self) -> None:
        """One short request through every phase before serving, so the first real request does not
        pay for lazy initialisation; it leaves no trace in the metrics."""
        self.add(WARMUP_REQUEST_ID, list(range(1, 9)),
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while WARMUP_REQUEST_ID in self.requests:
            out = self.schedule()
            if out.scheduled:
                self.update(out, self.execute(out), record=False)

    def update(self, out: SchedulerOutput, sampled: list[int | None], record: bool = True) -> list[RequestOutput]:
        """Phase 3: advance the sequences with their sampled tokens; the outputs to stream. `record`
        False keeps the step out of the metrics."""
        now = time.monotonic()
        advanced = self.scheduler.update(out, sampled)
        outputs = []
        for seq in advanced:
            request = self.requests[seq.request_id]
            if seq.times.first_token is None:
                seq.times.first_token = now
            if request.detokenizer.add(seq.token_ids[-1]):
                self.scheduler.finish(seq, "stop")
            outputs.append(self._output(request, now, record))
        if self.metrics and record:
            num_generated = sum(1 for t in sampled if t is not None)
            self.metrics.record_step(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.block_manager.usage, out.num_tokens - num_generated,
                                     num_generated, out.num_preempted)
            if out.prefix_queried_tokens:
                self.metrics.record_prefix_lookup(out.prefix_queried_tokens, out.prefix_hit_tokens)
        return outputs

    def abort(self, request_id: str, outcome: str = "abort") -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request.seq, outcome)
        request.seq.times.outcome = outcome
        return self._output(request, time.monotonic())

    def _output(self, request: Request, now: float, record: bool = True) -> RequestOutput:
        seq = request.seq
        new_tokens = seq.output_token_ids[request.num_sent_tokens :]
        request.num_sent_tokens = seq.num_output_tokens
        output = RequestOutput(
            request_id=seq.request_id,
            text=request.detokenizer.delta(seq.is_finished),
            token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        if seq.is_finished:
            seq.times.finished = now
            seq.times.num_output_tokens = seq.num_output_tokens
            if self.metrics and record:
                self.metrics.record_finished(seq.times)
            self.runner.forget(seq.request_id)
            del self.requests[seq.request_id]
        return output
