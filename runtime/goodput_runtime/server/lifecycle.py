"""The server's life: listen, load and warm the engine, serve, then drain on a stop signal.

Health answers 503 while the model loads, 200 once the engine is warm, and 503 again from
the moment a stop arrives. New requests are still served for ``shutdown_delay`` seconds after
the stop (the time Kubernetes takes to take the pod out of its Services' endpoints), each
response saying ``Connection: close``; then new requests get 503 and in-flight requests get
up to ``shutdown_grace`` seconds to finish before they are aborted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.client import EngineClient
from goodput_runtime.loader import ModelLoadError
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.server.admission import Admission, AdmissionSettings
from goodput_runtime.server.app import build_app
from goodput_runtime.server.state import ServerState

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig, RuntimeMetrics], EngineClient]
POLL_SECONDS = 0.05
FINAL_WRITE_SECONDS = 5.0


class QuietAccessLogger(AccessLogger):
    """aiohttp's access log without the probes and scrapes that succeed every few seconds."""

    QUIET_PATHS = frozenset({"/health", "/metrics"})

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in self.QUIET_PATHS and response.status == 200:
            return
        super().log(request, response, time)


def load_engine(config: EngineConfig, metrics: RuntimeMetrics) -> EngineClient:
    from goodput_runtime.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(config, metrics)


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run a blocking load off the loop; a stop during loading need not wait for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def work() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # handed to the loop, which reports it
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            log.info("Model loaded after the server stopped; discarding it")

    threading.Thread(target=work, name="engine-loader", daemon=True).start()
    return future


async def wait_until(condition: Callable[[], bool], timeout: float, *interrupts: asyncio.Event) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if any(e.is_set() for e in interrupts) or asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(POLL_SECONDS)
    return True


async def serve(
    config: EngineConfig,
    metrics: RuntimeMetrics,
    host: str,
    port: int,
    shutdown_grace: float,
    stop: asyncio.Event,
    force: asyncio.Event | None = None,
    engine_factory: EngineFactory = load_engine,
    on_listening: Callable[[int], None] | None = None,
    shutdown_delay: float = 0.0,
    on_failure: Callable[[str], None] | None = None,
    api_keys: tuple[str, ...] = (),
    admission: AdmissionSettings | None = None,
    freeze_heap: bool = False,
) -> int:
    """Serve until ``stop`` is set; return the process exit code.

    ``freeze_heap``: once the engine is up, move every object then alive out of the garbage
    collector's reach (``gc.freeze``), as a server process does: the model, tokenizer and libraries
    leave about half a million objects that every full collection would otherwise walk again,
    stalling the step thread's Python work (and the cores' other threads waiting on it) each time.

    ``api_keys``, when any, are asked of every request but /health and /metrics.
    ``admission``: refuse with 429 the requests predicted to miss the TTFT target (None: queue them all).

    ``on_failure`` hears, in one line, why the server cannot serve when it returns 1.
    """
    if force is None:
        force = asyncio.Event()

    def fail(reason: str) -> int:
        if on_failure is not None:
            on_failure(reason)
        return 1

    state = ServerState(
        config.model_name, metrics, config.model, api_keys, Admission(admission) if admission is not None else None
    )
    state.grammars.tool_call_parser = config.tool_call_parser
    state.allow_lora_updates = config.allow_runtime_lora_updating
    runner = web.AppRunner(
        build_app(state),
        handler_cancellation=True,
        shutdown_timeout=FINAL_WRITE_SECONDS,
        access_log_class=QuietAccessLogger,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        reason = f"Cannot listen on {host}:{port}: {exc.strerror or exc}"
        log.error("%s", reason)
        await runner.cleanup()
        return fail(reason)
    bound = runner.addresses[0][1]
    log.info("Listening on http://%s:%d (model %s loading)", host, bound, config.model)
    if on_listening is not None:
        on_listening(bound)
    engine: EngineClient | None = None
    try:
        try:
            engine = await load_or_stop(config, metrics, engine_factory, stop)
            if engine is None:
                return 0
            await engine.start()
        except (ModelLoadError, ValueError) as exc:
            reason = f"Cannot serve {config.model}: {exc}"
            log.error("%s", reason)
            return fail(reason)
        except Exception as exc:
            log.exception("Engine for model %s failed to start; exiting", config.model)
            return fail(f"Engine for model {config.model} failed to start: {type(exc).__name__}: {exc}")
        if freeze_heap:
            gc.collect()
            gc.freeze()
            log.info("Froze %d objects out of the garbage collector's scans", gc.get_freeze_count())
        state.set_ready(engine)
        log.info("Ready: serving %s as '%s'", config.model, state.model_name)
        await stop.wait()
        if shutdown_delay > 0:
            await shutdown_delay_phase(state, shutdown_delay, force)
            state.set_draining()
            if closed := close_idle_connections(runner):
                log.info("Closed %d idle keep-alive connections", closed)
        await drain(state, shutdown_grace, force)
        return 0
    finally:
        if state.phase in ("ready", "stopping"):
            state.set_draining()
        await runner.cleanup()
        if engine is not None:
            await engine.shutdown()
        log.info("Stopped")


async def load_or_stop(
    config: EngineConfig, metrics: RuntimeMetrics, factory: EngineFactory, stop: asyncio.Event
) -> EngineClient | None:
    loading = in_daemon_thread(lambda: factory(config, metrics))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        stopped.cancel()
        return loading.result()
    log.info("Stop requested while the model was loading; exiting")
    return None


async def shutdown_delay_phase(state: ServerState, delay: float, force: asyncio.Event) -> None:
    """Health 503 at once, but keep serving new requests for ``delay`` seconds (a second signal ends it).

    Kubernetes sends SIGTERM as it removes the pod from its Services' endpoints; kube-proxies
    and keep-alive clients keep sending here for a while yet, and those requests should succeed.
    """
    state.set_stopping()
    log.info(
        "Stopping: health is 503 now; still serving new requests for %.1fs, each told Connection: close (%d in flight)",
        delay,
        len(state.tracker),
    )
    try:
        await asyncio.wait_for(force.wait(), delay)
        log.warning("Shutdown delay cut short by a second signal")
    except asyncio.TimeoutError:
        log.info("Shutdown delay over: %d requests in flight", len(state.tracker))


def close_idle_connections(runner: web.AppRunner) -> int:
    """Hang up the keep-alive connections that wait for their next request, so their clients reconnect
    (by now to another pod) rather than get 503; busy ones close after their response (Connection: close).

    aiohttp has no public "idle" test: a connection waits for its next request on ``_waiter``. Its
    ``close()`` is no substitute: on an idle connection it stops reading but leaves the socket open.
    """
    closed = 0
    for connection in runner.server.connections if runner.server is not None else []:
        waiter = getattr(connection, "_waiter", None)
        if waiter is not None and not waiter.done():
            connection.force_close()
            closed += 1
    return closed


async def drain(state: ServerState, grace: float, force: asyncio.Event) -> None:
    state.set_draining()
    log.info("Draining: no longer admitting requests; %d in flight, up to %.1fs to finish", len(state.tracker), grace)
    if await wait_until(lambda: not state.tracker.active, grace, force):
        log.info("Drained: every in-flight request finished")
        return
    left = list(state.tracker.active)
    log.warning("Aborting %d requests still running", len(left))
    if state.engine is not None:
        for request_id in left:
            state.engine.abort(request_id)
    await wait_until(lambda: not state.tracker.active, FINAL_WRITE_SECONDS)
