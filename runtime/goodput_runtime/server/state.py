"""What the server's routes share: the engine once it is ready, the serving phase, requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from goodput_runtime.engine.client import EngineClient
from goodput_runtime.engine.lora_manager import LoraError
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.admission import Admission
from goodput_runtime.server.errors import APIError, invalid, unavailable
from goodput_runtime.server.generate import Tracker
from goodput_runtime.server.guided import Grammars
from goodput_runtime.server.responses import TokenText


class ServerState:
    """What the routes share: the engine once it is ready, and the serving phase."""

    def __init__(
        self,
        model_name: str,
        metrics: RuntimeMetrics,
        root: str | None = None,
        api_keys: tuple[str, ...] = (),
        admission: Admission | None = None,
    ) -> None:
        self.model_name = model_name
        self.api_keys = api_keys  # empty: no key is asked for
        self.root = root or model_name
        self.metrics = metrics
        self.engine: EngineClient | None = None
        self.phase = "loading"  # loading | ready | stopping | draining
        self.created = int(time.time())
        self.tracker = Tracker()
        self.token_text: TokenText | None = None
        self.admission = admission  # None: every request is queued (up to --max-queue)
        self.grammars = Grammars(metrics)
        self.allow_lora_updates = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter served

    def set_ready(self, engine: EngineClient) -> None:
        self.engine = engine
        if self.admission is not None:
            self.admission.attach(engine)
        self.token_text = TokenText(engine.tokenizer)
        self.phase = "ready"

    def set_stopping(self) -> None:
        """Health turns 503 so readiness drops, but new requests are still served (the shutdown delay)."""
        self.phase = "stopping"

    @property
    def closing(self) -> bool:
        """Once a stop has arrived, every response tells its client to reconnect elsewhere."""
        return self.phase in ("stopping", "draining")

    def set_draining(self) -> None:
        self.phase = "draining"
        if self.engine is not None:
            self.engine.stop_admitting()

    def serving_engine(self) -> EngineClient:
        if self.phase == "draining":
            raise unavailable("The server is shutting down and accepts no new requests", "shutting_down")
        if self.phase == "loading" or self.engine is None:
            raise unavailable("The model is still loading; retry shortly", "model_loading")
        return self.engine

    def admit(
        self, engine: EngineClient, prompt_ids: list[int], params: SamplingParams, remote_tokens: int = 0
    ) -> dict[str, str]:
        """429 now for a request predicted to miss the TTFT or TPOT target (see admission.py); else
        the headers that carry admission's predictions. remote_tokens: prompt tokens a KV hand-off
        brings (a decode phase), which this runtime does not compute. A request carrying its own
        targets (params.slo_ttft, params.slo_tpot) is judged by them, and counted by the decision."""
        if self.admission is None:
            return {}
        own = (params.slo_ttft is not None or params.slo_tpot is not None) and params.priority <= 0
        try:
            headers = self.admission.check(engine, max(1, len(prompt_ids) - remote_tokens), params)
        except APIError as err:
            if own and err.status == 429:
                self.metrics.record_own_slo(admitted=False)
            raise
        if own:
            self.metrics.record_own_slo(admitted=True)
        return headers

    async def resolve_model(self, model: str) -> str | None:
        """check_model, once an adapter of that name is loaded from --lora-source if it is there (the
        request waits for the load); an adapter there that cannot be served is a 400 naming why."""
        engine = self.engine
        if model != self.model_name and engine is not None and engine.lora is not None:
            shown = self.metrics.lora if model not in engine.lora.by_name else None  # goodput_lora_loading
            try:
                with shown.record_loading(model) if shown is not None else contextlib.nullcontext():
                    await engine.ensure_lora(model)
            except LoraError as exc:
                raise APIError(exc.status, str(exc), param="model", code=exc.code) from None
            except asyncio.TimeoutError:
                raise unavailable(f"The adapter '{model}' is still loading; retry shortly", "lora_loading") from None
        return self.check_model(model)

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the base model). An unknown name is a 404 where
        adapters are enabled (as vLLM answers), a 400 where the server serves one model."""
        if model == self.model_name:
            return None
        adapters = self.engine.lora if self.engine is not None else None
        if adapters is not None:
            if model in adapters.by_name:
                return model
            raise APIError(
                404,
                f"The model '{model}' does not exist: this server serves '{self.model_name}' and its adapters "
                "(GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
        raise invalid(
            f"The model '{model}' does not exist; this server serves '{self.model_name}'",
            "model",
            "model_not_found",
        )


STATE = web.AppKey("state", ServerState)
