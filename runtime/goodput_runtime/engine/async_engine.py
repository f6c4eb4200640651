"""The engine as the server sees it (an EngineClient, client.py): requests in, streams of outputs back,
a step loop in between.

Scheduling and bookkeeping run on the event loop; only the forward pass runs in a worker
thread, so HTTP stays responsive while the model computes. Aborts that arrive during a
step are applied right after it, never while the worker reads the batch.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import lora_sources
from goodput_runtime.engine.client import StepObserver
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.engine.kv_transfer.agent import KVTransferAgent
from goodput_runtime.engine.kv_transfer.base import KVTransferError
from goodput_runtime.engine.kv_transfer.params import HandoffParams
from goodput_runtime.engine.lora_manager import LoraAdapter, LoraError, LoraManager
from goodput_runtime.engine.outputs import EngineStoppedError, QueueFullError, RequestOutput
from goodput_runtime.engine.scheduler import Scheduler, SchedulerOutput
from goodput_runtime.engine.sequence import PoolingParams
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

# every architecture the runtime serves is a decoder-only causal LM, whose last position alone has
# attended to the whole input: vLLM pools such models by their last token too
DEFAULT_POOLING = "last"


LORA_DIR_NAME = re.compile(r"[A-Za-z0-9][-_.A-Za-z0-9]*")  # an adapter's subdirectory of --lora-source
LORA_LOAD_TIMEOUT_S = 120.0  # a request waits this long at most for its adapter's first load


class RequestStream:
    """Outputs of one request, in order, ending with the one marked finished."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        output = await self.queue.get()
        self.done = output.finished
        return output


class AsyncEngine:
    def __init__(self, core: EngineCore, config: EngineConfig) -> None:
        self.core = core
        self.config = config
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.streams: dict[str, RequestStream] = {}
        self.pending_aborts: list[str] = []
        self.stepping = False
        self.admitting = True
        self.wakeup = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        # one thread runs every forward pass, so a step still running at shutdown can be waited for
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.step_observers: list[StepObserver] = []
        # the last step and when it was scheduled: the scheduler learns each step's whole cycle (forward
        # pass, update, the handlers that run before the next step), the time between a request's tokens
        self.last_step: tuple[SchedulerOutput, float] | None = None
        self.lora_loads: dict[str, asyncio.Future] = {}  # adapters being loaded on first use, by name
        # the KV hand-off's side of this engine (engine/kv_transfer/agent.py); None with role none
        self.kv_transfer: KVTransferAgent | None = None
        if config.kv_transfer_role != "none":
            self.kv_transfer = KVTransferAgent(core, config, self.executor)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: RuntimeMetrics | None = None) -> AsyncEngine:
        from goodput_runtime.engine.builder import build_core

        return cls(build_core(config, metrics), config)

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's generation_config.json settings for requests silent on them."""
        return self.core.sampling_defaults

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.core.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.core.block_manager.num_blocks

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    async def start(self) -> None:
        """Warm up (on the step thread, where every later forward pass runs), then start the step loop."""
        await asyncio.get_running_loop().run_in_executor(self.executor, self.core.warmup)
        self.wakeup = asyncio.Event()
        self.loop_task = asyncio.create_task(self._run(), name="engine-loop")
        if self.kv_transfer is not None:
            await self.kv_transfer.start()

    @property
    def pooling(self) -> str:
        """How embedding requests pool the final hidden states: --pooling, else the model's default."""
        return self.config.pooling or DEFAULT_POOLING

    @property
    def embedding_size(self) -> int:
        """The length of an embedding: the model's hidden size."""
        return int(self.core.runner.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.core.runner.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.scheduler.eos_token_ids

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: PoolingParams | None = None,
        kv_role: str | None = None,
    ) -> RequestStream:
        """kv_role "prefill": the prompt's blocks stay under a lease at the finish, whose hand-off the
        finished output carries (engine/kv_transfer/); "decode" is add_handoff_request's."""
        if not self.admitting or self.loop_task is None:
            raise EngineStoppedError("the server is shutting down and admits no new requests")
        if self.num_waiting >= self.config.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (--max-queue)")
        if request_id in self.streams:
            raise ValueError(f"request id {request_id} is already in use")
        self.core.add(request_id, prompt_token_ids, params, pooling, kv_role)
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        self.wakeup.set()
        return stream

    async def add_handoff_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, handoff: HandoffParams
    ) -> RequestStream:
        """A decode runtime's request: its prompt's blocks are pulled from the prefill runtime `handoff`
        names (the request parked meanwhile, other requests' steps going on), then it is queued. On a
        failed hand-off the prompt is computed here, or, with --kv-failure-policy fail, KVTransferError
        is raised (a layout mismatch is always computed here)."""
        assert self.kv_transfer is not None
        stream = self.add_request(request_id, prompt_token_ids, params, kv_role="decode")
        seq = self.core.requests[request_id].seq
        try:
            await self.kv_transfer.handoff(seq, handoff)
        except KVTransferError as exc:
            if not seq.is_finished:
                self.core.block_manager.free_seq(seq)
                if self.config.kv_failure_policy == "fail" and exc.reason != "layout_mismatch":
                    self.abort(request_id)
                    raise
        except BaseException:
            self.abort(request_id)  # the client left (the handler was cancelled): nothing leaks
            raise
        self.core.scheduler.unpark(seq)
        self.wakeup.set()
        return stream

    @property
    def lora(self) -> LoraManager | None:
        """The LoRA adapters' tiers and slots; None when adapters are not enabled."""
        return self.core.lora

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> LoraAdapter:
        """Read and check the adapter at `path` on a thread (the steps go on), then register it as `name`."""
        manager = self.core.lora
        if manager is None:
            raise LoraError("LoRA adapters are not enabled on this server (--enable-lora)")
        adapter = await asyncio.to_thread(manager.read, name, path)
        return manager.add(adapter, pinned)

    async def ensure_lora(self, name: str) -> bool:
        """Whether `name` is an adapter the engine serves, loading it first from --lora-source when it is
        a subdirectory there (concurrent requests for it share one load). Raises LoraError for an adapter
        there that cannot be served."""
        manager = self.core.lora
        if manager is None:
            return False
        if name in manager.by_name:
            return True
        source = self.config.lora_source
        if source is None or not LORA_DIR_NAME.fullmatch(name) or ".." in name:
            return False
        path = lora_sources.under(source, name)  # hf://ORG/NAME, or the subdirectory holding an adapter
        if path is None:
            return False
        task = self.lora_loads.get(name)
        if task is None:
            task = self.lora_loads[name] = asyncio.ensure_future(self._load_counted(name, path))
            task.add_done_callback(lambda _: self.lora_loads.pop(name, None))
        metrics = self.core.metrics  # a request waiting for the load is queued demand (the autoscaler's)
        if metrics is not None:
            metrics.record_lora_wait(1)
        try:
            await asyncio.wait_for(asyncio.shield(task), LORA_LOAD_TIMEOUT_S)
        finally:
            if metrics is not None:
                metrics.record_lora_wait(-1)
        return True

    async def _load_counted(self, name: str, path: str) -> LoraAdapter:
        """load_lora, counted in the metrics by result."""
        started, metrics = time.monotonic(), self.core.metrics
        try:
            adapter = await self.load_lora(name, path)
        except LoraError:
            if metrics is not None:
                metrics.record_lora_load("error", time.monotonic() - started)
            raise
        if metrics is not None:
            metrics.record_lora_load("ok", time.monotonic() - started)
        return adapter

    def unload_lora(self, name: str) -> bool:
        manager = self.core.lora
        return manager is not None and manager.remove(name)

    def abort(self, request_id: str) -> None:
        if request_id not in self.streams:
            return
        if self.stepping:
            self.pending_aborts.append(request_id)
        else:
            self._abort_now(request_id)

    def stop_admitting(self) -> None:
        self.admitting = False

    async def shutdown(self) -> None:
        self.admitting = False
        if self.loop_task:
            self.loop_task.cancel()
            try:
                await self.loop_task
            except asyncio.CancelledError:
                pass
            self.loop_task = None
        if self.kv_transfer is not None:
            await self.kv_transfer.stop()
        await asyncio.to_thread(self.executor.shutdown, True)
        self.stepping = False
        for request_id in list(self.streams):
            self._abort_now(request_id)
        await asyncio.to_thread(self.core.close)

    @property
    def alive(self) -> bool:
        """False once the step loop has stopped: nothing will make progress any more."""
        return self.loop_task is not None and not self.loop_task.done()

    async def _run(self) -> None:
        while True:
            if not self.core.has_unfinished():
                self.last_step = None  # the next step starts from idle: no cycle to time
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                await self._step()
            except Exception:
                # a bug, not a bad request: fail what is in flight, keep serving the rest
                log.exception("Engine step failed; failing %d requests", len(self.streams))
                self.stepping = False
                self.last_step = None
                self.pending_aborts.clear()  # every stream is failed below, those included
                for request_id in list(self.streams):
                    self._abort_now(request_id, outcome="error")
            await asyncio.sleep(0)  # let handlers read their outputs before the next step

    async def _step(self) -> None:
        """EngineCore's three phases, with the forward pass on the step thread."""
        core = self.core
        scheduled_at = time.monotonic()
        if self.last_step is not None:
            last, last_at = self.last_step
            core.scheduler.observe_step(last, scheduled_at - last_at)
            self.last_step = None
        out = core.schedule()
        for output in core.take_lora_failures():
            self._deliver(output)
        if not out.scheduled:
            await asyncio.sleep(0.001)  # nothing fits this instant: let aborts and arrivals in
            return
        self.last_step = (out, scheduled_at)
        self.stepping = True
        started = time.monotonic()
        try:
            sampled = await asyncio.get_running_loop().run_in_executor(self.executor, core.execute, out)
        finally:
            self.stepping = False
        seconds = time.monotonic() - started
        try:
            for output in core.update(out, sampled):
                self._deliver(output)
        finally:
            aborts, self.pending_aborts = self.pending_aborts, []
            for request_id in aborts:
                self._abort_now(request_id)
        for observe in self.step_observers:
            observe(out.scheduled, seconds)

    def _abort_now(self, request_id: str, outcome: str = "abort") -> None:
        for output in self.core.abort(request_id, outcome):
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self.streams.get(output.request_id)
        if stream is None:
            return
        stream.queue.put_nowait(output)
        if output.finished:
            del self.streams[output.request_id]
