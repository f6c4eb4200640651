"""One engine step in three phases: schedule → execute → update.

Synchronous. `step()` runs the three in a row; the async engine calls the same phases itself so
that `execute`, the forward pass, runs on its worker thread while the event loop stays free.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.detokenizer import IncrementalDetokenizer
from goodput_runtime.engine.lora_manager import LoraManager, LoraNotFound
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.outputs import InvalidPromptError, PromptTooLongError, RequestOutput, TokenLogprob
from goodput_runtime.engine.parallel import Followers
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import PoolingParams, Sequence
from goodput_runtime.engine.step import StepResult
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "warmup"


@dataclass
class Choice:
    """One of a request's choices: its sequence, its text so far, what was already handed out."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0
    num_detokenized: int = 0  # output tokens the detokenizer has seen
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens not yet handed out
    sent_prompt_logprobs: bool = False
    done: bool = False  # its final output was handed out


@dataclass
class Request:
    choices: list[Choice]
    # the prompt's logprobs as they are computed, the first token's None; None when not asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector, once its prompt is computed

    @property
    def seq(self) -> Sequence:
        """The first choice's sequence: the one that runs the prefill."""
        return self.choices[0].seq


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        max_model_len: int,
        metrics: RuntimeMetrics | None = None,
        followers: Followers | None = None,
        sampling_defaults: dict[str, float | int] | None = None,
    ) -> None:
        self.runner = runner
        self.followers = followers  # the other tensor-parallel ranks, when there are any
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics
        # the model's generation_config.json settings, applied by the server where a request is silent
        self.sampling_defaults = dict(sampling_defaults or {})
        runner.sampler.eos_token_ids = scheduler.eos_token_ids  # min_tokens holds them off
        self.requests: dict[str, Request] = {}
        self.lora: LoraManager | None = scheduler.lora  # LoRA adapters' tiers and slots, when enabled

    def _cache_salt(self, params: SamplingParams) -> str:
        """The prefix-cache salt of a request on params.lora's adapter ("" for the base model); raises
        LoraNotFound for an adapter the engine does not know."""
        if params.lora is None:
            return ""
        if self.lora is None:
            raise LoraNotFound(f"the model {params.lora!r} does not exist (LoRA adapters are not enabled)")
        return self.lora.get(params.lora).key

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: PoolingParams | None = None,
        kv_role: str | None = None,
    ) -> None:
        """Queue a request. With `pooling` it is an embedding request: its prompt is prefilled like any
        other (chunked, sharing steps with generation), then pooled instead of sampled; it finishes with
        its vector in the output and generates nothing (params then only need n == 1).
        kv_role (engine/kv_transfer/): "prefill" keeps the prompt's blocks under a lease at its finish;
        "decode" parks the request until its prompt's blocks are pulled (the caller unparks it)."""
        if pooling is not None:
            self._add_embedding(request_id, prompt_token_ids, params, pooling)
            return
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; with at least one generated token it "
                f"exceeds the maximum model length of {self.max_model_len} tokens"
            )
        if not prompt_token_ids:
            raise InvalidPromptError("the prompt is empty")
        salt = self._cache_salt(params)
        first = Sequence.new(request_id, prompt_token_ids, params, time.monotonic())
        seqs = [first] + [
            Sequence.new(
                request_id,
                prompt_token_ids,
                dataclasses.replace(params, seed=params.choice_seed(i)),
                first.times.arrival,
                first.times,
                index=i,
            )
            for i in range(1, params.n)
        ]
        first.forks = seqs[1:]  # forked from the first choice once its prefill ends
        for seq in seqs:
            seq.cache_salt = salt
        if params.grammar is not None:
            for seq in seqs:
                seq.grammar = params.grammar.matcher()
        choices = [Choice(seq, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)) for seq in seqs]
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None]
        self.requests[request_id] = Request(choices, prompt_logprobs)
        first.lease_kv = kv_role == "prefill"
        if kv_role == "decode":
            self.scheduler.park(first)
        else:
            self.scheduler.add(first)

    def _add_embedding(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams
    ) -> None:
        if len(prompt_token_ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the input has {len(prompt_token_ids)} tokens, more than the maximum model "
                f"length of {self.max_model_len} tokens"
            )
        if not prompt_token_ids:
            raise InvalidPromptError("the input is empty")
        if params.n != 1 or params.prompt_logprobs is not None:
            raise ValueError("an embedding request has one choice and no logprobs")
        salt = self._cache_salt(params)
        seq = Sequence.new(request_id, prompt_token_ids, params, time.monotonic())
        seq.pooling = pooling
        seq.cache_salt = salt
        self.requests[request_id] = Request([Choice(seq, IncrementalDetokenizer(self.tokenizer, [], ()))])
        self.scheduler.add(seq)

    def close(self) -> None:
        if self.block_manager.offload is not None:
            self.block_manager.offload.close()  # its file goes with it
        if self.followers is not None:
            self.followers.stop()
            self.followers = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        out = self.schedule()
        if not out.scheduled:
            return []
        started = time.monotonic()
        result = self.execute(out)
        self.scheduler.observe_step(out, time.monotonic() - started)
        return self.update(out, result)

    def schedule(self) -> SchedulerOutput:
        """Phase 1: which sequences run this step, and how many tokens each."""
        return self.scheduler.schedule()

    def take_lora_failures(self) -> list[RequestOutput]:
        """The final outputs of requests whose adapter was unloaded before they got a slot."""
        failed, self.scheduler.lora_failed = self.scheduler.lora_failed, []
        outputs: list[RequestOutput] = []
        for seq in failed:
            outputs.extend(self.abort(seq.request_id, "error"))
        return outputs

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Phase 2, the forward pass: the sampled token per scheduled sequence (None mid-prefill), one
        per choice forking there, and logprobs. Touches only the runner's tensors, so it may run on
        another thread than the other phases."""
        return self.runner.run(out)

    def warmup(self) -> None:
        """One short request through every phase before serving, so the first real request does not
        pay for lazy initialisation; it leaves no trace in the metrics."""
        self.add(WARMUP_REQUEST_ID, list(range(1, 9)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while WARMUP_REQUEST_ID in self.requests:
            out = self.schedule()
            self.take_lora_failures()
            if out.scheduled:
                self.update(out, self.execute(out), record=False)

    def update(self, out: SchedulerOutput, result: StepResult, record: bool = True) -> list[RequestOutput]:
        """Phase 3: advance the sequences with their sampled tokens; the outputs to stream. `record`
        False keeps the step out of the metrics."""
        now = time.monotonic()
        for pos, entries in result.prompt_logprobs.items():
            request = self.requests.get(out.scheduled[pos].seq.request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(entries)
        advanced = self.scheduler.update(out, result.tokens, result.fork_tokens, result.accepted, result.proposals)
        outputs = []
        for seq in advanced:
            request = self.requests[seq.request_id]
            choice = request.choices[seq.index]
            if seq.times.first_token is None:
                seq.times.first_token = now  # an embedding request's: when its vector is ready
            if seq.pooling is not None:
                request.embedding = result.embeddings[seq.key]
            logprob = result.logprobs.get(seq.key)
            if seq.params.max_tokens and seq.num_output_tokens:  # max_tokens 0: nothing was generated
                if logprob is not None:
                    choice.logprobs.append(logprob)
                self._detokenize(choice)
            outputs.append(self._output(request, choice, now, record))
        if self.metrics and record:
            num_sampling = sum(t is not None for t in result.tokens)  # forked choices computed nothing
            num_proposed = sum(len(s.draft) for s in out.scheduled)
            self.metrics.record_step(
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                self.block_manager.usage,
                out.num_tokens - num_sampling - num_proposed,
                result.num_sampled,
                out.num_preempted,
                self.scheduler.num_waiting_batch,
            )
            if self.scheduler.switch is not None:
                self.metrics.record_speculation(out.speculative, result.verified)
            if self.scheduler.batch_cap is not None:
                cap = self.scheduler.max_num_seqs if out.batch_cap is None else out.batch_cap
                self.metrics.record_batch_cap(cap, out.num_batch, out.batch_paused)
            if out.prefix_queried_tokens:
                self.metrics.record_prefix_lookup(out.prefix_queried_tokens, out.prefix_hit_tokens)
            if self.lora is not None and self.metrics.lora is not None:
                self.record_lora()
        return outputs

    def record_lora(self) -> None:
        """The adapters of running and waiting requests and the adapters per tier, to the metrics."""
        assert self.lora is not None and self.metrics is not None and self.metrics.lora is not None
        sched = self.scheduler
        running = [s.params.lora for s in sched.running if s.params.lora]
        waiting = [s.params.lora for s in sched.waiting if s.params.lora]
        slots, cpu = self.lora.resident()
        self.metrics.lora.record_adapters(running, waiting, (slots, cpu, len(self.lora.by_name)))

    def _detokenize(self, choice: Choice) -> None:
        """Feed the choice's new tokens (several after a verified proposal) to its detokenizer; a stop
        string cuts the output after the token completing it, as decoding one token at a time would."""
        seq = choice.seq
        new = seq.output_token_ids[choice.num_detokenized :]
        for i, token in enumerate(new):
            choice.num_detokenized += 1
            if not choice.detokenizer.add(token, choice.num_detokenized > seq.params.min_tokens):
                continue
            if i < len(new) - 1:  # tokens after the stop string were never generated
                del seq.token_ids[seq.num_prompt_tokens + choice.num_detokenized :]
                if seq.is_finished:
                    seq.finish_reason = "stop"
            if not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            return

    def abort(self, request_id: str, outcome: str = "abort") -> list[RequestOutput]:
        """Finish every choice of the request still running; the final output of each, the
        request's last one marked finished. Empty when the request is unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        request.seq.times.outcome = outcome
        open_choices = [c for c in request.choices if not c.done]
        for choice in open_choices:
            self.scheduler.finish(choice.seq, outcome)
        if self.metrics and open_choices:
            # the gauges move now, not at the next step: an idle engine may take none for a long while
            self.metrics.record_step(
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                self.block_manager.usage,
                0,
                0,
                0,
                self.scheduler.num_waiting_batch,
            )
        now = time.monotonic()
        return [self._output(request, choice, now) for choice in open_choices]

    def _output(self, request: Request, choice: Choice, now: float, record: bool = True) -> RequestOutput:
        seq = choice.seq
        new_tokens = seq.output_token_ids[choice.num_sent_tokens :]
        choice.num_sent_tokens = seq.num_output_tokens
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, choice.logprobs = choice.logprobs, []
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not choice.sent_prompt_logprobs:
            # handed out with the choice's first output, once the prefill is complete
            choice.sent_prompt_logprobs = True
            prompt_logprobs = request.prompt_logprobs[: seq.num_prompt_tokens]
        # held bytes of an incomplete last character come out as U+FFFD (see detokenizer.py)
        ending = seq.is_finished and not choice.done and seq.pooling is None
        stopped = ending and choice.detokenizer.flush(seq.num_output_tokens > seq.params.min_tokens)
        if stopped and seq.finish_reason == "length":
            seq.finish_reason = "stop"  # the flushed text completed a stop string
        choice.done = seq.is_finished
        finished = all(c.done for c in request.choices)
        text = choice.detokenizer.delta(seq.is_finished)
        output = RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=new_tokens,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=request.seq.num_cached_tokens,
            index=seq.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            embedding=request.embedding,
            kv_transfer_params=seq.kv_handoff if finished else None,
            num_shown_tokens=seq.num_output_tokens if seq.is_finished else choice.detokenizer.shown_tokens,
        )
        if finished:
            times = seq.times  # shared by every choice
            times.finished = now
            times.num_output_tokens = max(c.seq.num_output_tokens for c in request.choices)
            if self.metrics and record:
                self.metrics.record_finished(times)
            self.runner.forget(seq.request_id)
            del self.requests[seq.request_id]
        return output
