"""Adapters loaded and unloaded at run time, in vLLM's shapes (served with --allow-runtime-lora-updating,
behind the API key like every route):

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?, "pinned"?}``: the adapter
  (a directory, ``file://``, or ``hf://ORG/REPO[@REVISION]`` fetched into the disk cache) is read and
  checked on a thread (steps go on meanwhile), then served under its name; 200 with a line of text.
  ``load_inplace`` replaces an adapter of that name (its running requests finish on the old
  weights; the prefix cache keeps the two apart); without it a taken name is a 400, as in vLLM.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200, or 404 for a name not loaded.

Refusals are OpenAI-shaped and name their cause: a rank above --max-lora-rank, target modules the
model lacks, weights of another base model's shapes, a corrupt or missing file, a repository that is no
PEFT adapter (400), an unknown adapter or repository (404), a Hub that cannot be reached (503).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from goodput_runtime.engine import lora_sources
from goodput_runtime.engine.lora_manager import LoraError
from goodput_runtime.server.errors import APIError, invalid, missing, wrong_type
from goodput_runtime.server.protocol import parse_json, reject_unknown
from goodput_runtime.server.state import STATE

log = logging.getLogger(__name__)

LOAD_FIELDS = frozenset({"lora_name", "lora_path", "load_inplace", "pinned"})
UNLOAD_FIELDS = frozenset({"lora_name"})


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise missing(name)
    if not isinstance(value, str) or not value.strip():
        raise wrong_type(name, "a non-empty string")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean")
    return value


def _lora_error(exc: LoraError, param: str) -> APIError:
    return APIError(exc.status, str(exc), param=param, code=exc.code)


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_json(await request.read())
    reject_unknown(body, LOAD_FIELDS)
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    inplace, pinned = _flag(body, "load_inplace"), _flag(body, "pinned")
    engine = state.serving_engine()
    manager = engine.lora
    if manager is None:
        raise invalid("LoRA adapters are not enabled on this server (--enable-lora)", "lora_name", "lora_disabled")
    if name == state.model_name:
        raise invalid(f"'lora_name' {name!r} is the base model's name", "lora_name")
    if name in manager.by_name and not inplace:
        raise invalid(
            f"The lora adapter '{name}' has already been loaded (load_inplace replaces it)", "lora_name", "lora_exists"
        )
    if lora_sources.scheme(path) not in (None, "file", "hf"):
        raise invalid(
            f"'lora_path' {path!r}: a directory the server can read (a path or file://) or an hf://ORG/REPO "
            "source is loaded here",
            "lora_path",
            "unsupported_value",
        )
    started = time.monotonic()
    shown = state.metrics.lora if name not in manager.by_name else None  # goodput_lora_loading while it loads
    try:
        with shown.record_loading(name) if shown is not None else contextlib.nullcontext():
            adapter = await engine.load_lora(name, path, pinned)
    except LoraError as exc:
        state.metrics.record_lora_load("error", time.monotonic() - started)
        raise _lora_error(exc, "lora_path") from None
    state.metrics.record_lora_load("ok", time.monotonic() - started)
    log.info("Loaded LoRA adapter %s from %s in %.2f s", name, adapter.path, time.monotonic() - started)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_json(await request.read())
    reject_unknown(body, UNLOAD_FIELDS)
    name = _string(body, "lora_name")
    engine = state.serving_engine()
    if not engine.unload_lora(name):
        raise APIError(
            404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_adapter_not_found"
        )
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
