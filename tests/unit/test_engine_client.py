"""AsyncEngine is the EngineClient the server types against: every member of the protocol, methods with
the protocol's parameters and the same sync or async kind, figures read from the engine's parts.

mypy checks the same structurally where the server builds its engine (``lifecycle.load_engine`` returns
an AsyncEngine as an EngineClient); this test fails as well when a member is renamed on one side only.
"""

import inspect
from types import SimpleNamespace

import pytest

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.async_engine import AsyncEngine
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.client import EngineClient
from goodput_runtime.engine.scheduler import Scheduler

MEMBERS = {name for name, value in vars(EngineClient).items() if not name.startswith("_")}
METHODS = sorted(name for name in MEMBERS if inspect.isfunction(vars(EngineClient)[name]))


def engine() -> tuple[AsyncEngine, Scheduler]:
    """An AsyncEngine over a core with the real scheduler and block manager (no model, no tokenizer)."""
    scheduler = Scheduler(BlockManager(16, 4), 4, 64, 256, eos_token_ids=frozenset({2}))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8, vocab_size=40))
    core = SimpleNamespace(
        tokenizer=object(),
        max_model_len=256,
        scheduler=scheduler,
        block_manager=scheduler.block_manager,
        lora=scheduler.lora,
        runner=SimpleNamespace(model=model),
        sampling_defaults={"temperature": 0.6},
    )
    return AsyncEngine(core, EngineConfig(model="tiny", pooling="mean")), scheduler


def test_the_protocol_covers_what_the_server_uses() -> None:
    assert {"add_request", "abort", "scheduler", "step_observers", "tokenizer", "embedding_size"} <= MEMBERS


def test_the_async_engine_is_an_engine_client() -> None:
    client, _ = engine()
    assert isinstance(client, EngineClient)
    assert all(hasattr(client, name) for name in MEMBERS)


@pytest.mark.parametrize("name", METHODS)
def test_each_method_takes_the_protocol_s_parameters(name: str) -> None:
    wanted, actual = vars(EngineClient)[name], getattr(AsyncEngine, name)
    assert list(inspect.signature(actual).parameters) == list(inspect.signature(wanted).parameters)
    assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(wanted)


def test_the_figures_come_from_the_engine_s_parts() -> None:
    client, scheduler = engine()
    assert client.scheduler is scheduler
    assert (client.num_waiting, client.num_streams) == (0, 0)
    assert client.num_free_blocks == client.num_total_blocks == 16
    assert (client.vocab_size, client.embedding_size, client.eos_token_ids) == (40, 8, frozenset({2}))
    assert (client.pooling, client.sampling_defaults) == ("mean", {"temperature": 0.6})
    assert not client.alive  # no step loop before start()
