"""The engine as the server sees it: one protocol for everything the server asks of a running engine.

The server's modules hold the engine as an ``EngineClient``; ``AsyncEngine`` (async_engine.py)
implements it, and server/lifecycle.py builds one. Anything new the server needs from the engine goes
onto this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from goodput_runtime.engine.kv_transfer.agent import KVTransferAgent
from goodput_runtime.engine.kv_transfer.params import HandoffParams
from goodput_runtime.engine.lora_manager import LoraAdapter, LoraManager
from goodput_runtime.engine.outputs import RequestOutput
from goodput_runtime.engine.scheduler import ScheduledSeq, Scheduler
from goodput_runtime.engine.sequence import PoolingParams
from goodput_runtime.sampling import SamplingParams

# called after each step with its scheduled sequences and the forward pass's seconds
StepObserver = Callable[[list[ScheduledSeq], float], None]


@runtime_checkable
class EngineClient(Protocol):
    # the model: what a request is checked, tokenized and shaped against
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """The logits' width, which a grammar's token mask covers (the tokenizer's may be smaller)."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's generation_config.json settings, for requests silent on them."""
        ...

    @property
    def pooling(self) -> str:
        """How embedding requests pool the final hidden states."""
        ...

    @property
    def embedding_size(self) -> int: ...

    # requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: PoolingParams | None = None,
        kv_role: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, in order, the last one finished. Raises QueueFullError when the
        queue is full and EngineStoppedError once the engine admits nothing more. kv_role "prefill"
        keeps the prompt's blocks under a lease for a decode runtime (engine/kv_transfer/)."""
        ...

    async def add_handoff_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, handoff: HandoffParams
    ) -> AsyncIterator[RequestOutput]:
        """A decode runtime's request (engine/kv_transfer/): its prompt's blocks are pulled from the
        prefill runtime first. Raises KVTransferError when that fails under --kv-failure-policy fail."""
        ...

    @property
    def kv_transfer(self) -> KVTransferAgent | None:
        """The KV hand-off's side of this engine (its role, leases, counts); None with role none."""
        ...

    def abort(self, request_id: str) -> None: ...

    # LoRA adapters (engine/lora_manager.py)
    @property
    def lora(self) -> LoraManager | None:
        """The adapters' tiers and slots (read, never changed here); None when adapters are not enabled."""
        ...

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> LoraAdapter:
        """Read and check the adapter off the step loop, then serve it as `name`; raises LoraError."""
        ...

    async def ensure_lora(self, name: str) -> bool:
        """Whether `name` is a served adapter, loading it on first use from a configured source."""
        ...

    def unload_lora(self, name: str) -> bool:
        """Stop serving `name`; False when it is not loaded."""
        ...

    # load: what SLO-aware admission predicts from, and /debug/state shows
    @property
    def scheduler(self) -> Scheduler:
        """The running and waiting sequences, the step's budgets and the KV blocks (read, never changed)."""
        ...

    @property
    def step_observers(self) -> list[StepObserver]: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_streams(self) -> int:
        """Requests whose outputs are still being streamed."""
        ...

    # life
    @property
    def alive(self) -> bool:
        """False once the step loop has stopped."""
        ...

    async def start(self) -> None: ...

    def stop_admitting(self) -> None: ...

    async def shutdown(self) -> None: ...
