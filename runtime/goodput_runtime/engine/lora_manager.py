"""LoRA adapters in PEFT's format: read and checked, kept in a CPU tier, placed in the model's slots.

Tiers:

- **registered**: every adapter the runtime knows by name (``--lora-modules``, or loaded at run time
  through the API), with the directory it came from;
- **CPU**: the adapters whose weights are held in memory, at most ``--max-cpu-loras``, least recently
  used dropped first (a dropped adapter is read again from its directory when next needed); pinned
  adapters never leave;
- **slots**: ``--max-loras`` places in the model's LoRA stacks (layers/lora.py) that a step can use,
  slot 0 being the base model. The scheduler asks for a slot when it admits a sequence; a slot whose
  adapter no running sequence uses is reused, least recently used first, pinned adapters last.

An adapter is known in the engine by its key, its name and the digest of its weights: the prefix
cache's salt (engine/prefix_digest.py), and what a slot holds. An adapter loaded again under its name
with new weights is a new key: sequences still running on the old weights keep their slot, new ones
get the new weights, and neither shares cached blocks with the other.

Reading an adapter (``read_adapter``) touches only the disk and the CPU: callers run it off the step
loop (the server on a thread). Everything else here runs on the engine's loop, between steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from goodput_runtime.engine import lora_sources
from goodput_runtime.engine.lora_errors import LoraError, LoraNotFound
from goodput_runtime.engine.prefix_digest import adapter_salt
from goodput_runtime.layers.lora import LoraStack

log = logging.getLogger(__name__)

__all__ = ["LoraAdapter", "LoraError", "LoraManager", "LoraNotFound", "ModelShape", "model_shape", "read_adapter"]

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # of adapter_model.safetensors' bytes
    base_model: str | None
    modules: tuple[str, ...]  # the PEFT module names it changes
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None  # (layer, module) -> (A, B); None: on disk
    nbytes: int
    pinned: bool = False
    loaded_at: float = field(default_factory=time.time)
    # each touched stack's slot contents (LoraStack.image), by id of the stack; built with the weights, off
    # the loop, dropped with them
    images: dict[int, tuple[torch.Tensor, ...]] | None = None

    @property
    def key(self) -> str:
        return adapter_salt(self.name, self.digest)


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must match: the model's layers and each module's (in, out) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # module name -> (in, out)
    name: str  # the served model, for messages


def model_shape(model_config: Any, name: str) -> ModelShape:
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim
    q = c.num_attention_heads * head_dim
    h, i = c.hidden_size, c.intermediate_size
    features = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return ModelShape(c.num_hidden_layers, features, name)


def read_adapter(name: str, path: str | Path, shape: ModelShape, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    root = lora_sources.local_dir(name, path)  # an hf:// source fetched into the disk cache first
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not root.is_dir():
        raise LoraError(f"adapter {name!r}: {root} is not a directory")
    for f in (config_file, weights_file):
        if not f.is_file():
            raise LoraError(f"adapter {name!r}: {f.name} is missing from {root}")
    try:
        config = json.loads(config_file.read_text())
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"adapter {name!r}: adapter_config.json is not valid JSON ({e})") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, off) not in (off, None):
            raise LoraError(f"adapter {name!r}: {key}={config[key]!r} is not supported")
    for key in ("modules_to_save", "alpha_pattern", "rank_pattern"):
        if config.get(key):
            raise LoraError(f"adapter {name!r}: {key} is not supported")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: adapter_config.json needs an integer r ({e})") from e
    if rank < 1:
        raise LoraError(f"adapter {name!r}: rank {rank} must be at least 1")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r} has rank {rank}, above the maximum of {max_rank} (--max-lora-rank)")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [m for m in MODULES if re.fullmatch(targets, m) or re.search(rf"\.{m}$", targets)] or [targets]
    lacking = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(MODULES))
    if lacking:
        raise LoraError(
            f"adapter {name!r} targets {', '.join(lacking)}, which the model lacks or the runtime does not adapt "
            f"(adaptable: {', '.join(MODULES)})"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    data = weights_file.read_bytes()
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors is corrupt ({e})") from e
    base = config.get("base_model_name_or_path")
    mismatch = f"adapter {name!r} was made for another base model ({base or 'unnamed'}, not {shape.name})"
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            module = key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] if ".lora_" in key else key
            raise LoraError(f"adapter {name!r} has weights for {module} ({key}), which the runtime does not adapt")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoraError(f"adapter {name!r} targets {module}, which the model lacks")
        if layer >= shape.num_layers:
            raise LoraError(f"{mismatch}: it has layer {layer}, the model {shape.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    nbytes = 0
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} lacks its lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        fin, fout = shape.features[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(
                f"adapter {name!r}: layer {layer} {module}'s A {list(a.shape)} and B {list(b.shape)} differ"
            )
        if a.shape[1] != fin or b.shape[0] != fout:
            raise LoraError(
                f"{mismatch}: layer {layer} {module} maps {a.shape[1]} to {b.shape[0]} features, "
                f"the model's {fin} to {fout}"
            )
        if a.shape[0] > max_rank:
            raise LoraError(f"adapter {name!r} has rank {a.shape[0]}, above the maximum of {max_rank}")
        weights[layer, module] = (a.float(), b.float())
        nbytes += (a.numel() + b.numel()) * 4
    if not weights:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    modules = tuple(sorted({m for _, m in weights}, key=MODULES.index))
    return LoraAdapter(name, str(root), rank, scaling, digest, base, modules, weights, nbytes)


class LoraManager:
    """The tiers and slots of one engine (see the module's docstring)."""

    def __init__(
        self,
        targets: dict[tuple[int, str], tuple[LoraStack, int]],
        shape: ModelShape,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        on_event: Any = None,
    ) -> None:
        self.targets = targets
        self.shape = shape
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.max_rank = max_rank
        self.by_name: dict[str, LoraAdapter] = {}  # registered adapters
        self.by_key: dict[str, LoraAdapter] = {}  # every adapter a sequence may still name (registered or in a slot)
        self.cpu: OrderedDict[str, None] = OrderedDict()  # keys with weights in memory, least recent first
        self.slots: list[str | None] = [None] * (max_loras + 1)  # slot -> key; slot 0 the base model
        self.slot_used: list[float] = [0.0] * (max_loras + 1)
        self.on_event = on_event  # (event, adapter name) -> None: metrics ("load", "evict_slot", "evict_cpu")
        self.stacks = {id(stack): stack for stack, _ in targets.values()}

    @property
    def slot_bytes(self) -> int:
        return sum(stack.nbytes for stack in self.stacks.values())

    def _event(self, event: str, name: str) -> None:
        if self.on_event is not None:
            self.on_event(event, name)

    # registration (the loop; the adapter read beforehand, off it)

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """read_adapter against this model, with its slot images: for a thread."""
        adapter = read_adapter(name, path, self.shape, self.max_rank)
        adapter.images = self.images(adapter)
        return adapter

    def images(self, adapter: LoraAdapter) -> dict[int, tuple[torch.Tensor, ...]]:
        """The slot contents of every stack the adapter touches."""
        assert adapter.weights is not None
        parts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in adapter.weights.items():
            stack, part = self.targets[layer, module]
            parts.setdefault(id(stack), {})[part] = pair
        with torch.no_grad():
            return {key: self.stacks[key].image(p, adapter.scaling) for key, p in parts.items()}

    def add(self, adapter: LoraAdapter, pinned: bool = False) -> LoraAdapter:
        """Register `adapter` under its name (replacing an adapter of that name: see the docstring)."""
        old = self.by_name.get(adapter.name)
        if old is not None and old.key != adapter.key:
            self._forget(old)
        existing = self.by_key.get(adapter.key)
        if existing is not None:  # the same weights again: keep the one that may sit in a slot
            existing.path, existing.pinned = adapter.path, existing.pinned or pinned
            if existing.weights is None:
                existing.weights, existing.images = adapter.weights, adapter.images
            adapter = existing
        adapter.pinned = adapter.pinned or pinned
        self.by_name[adapter.name] = adapter
        self.by_key[adapter.key] = adapter
        self._hold(adapter)
        log.info(
            "LoRA adapter %s registered: rank %d, scaling %g, %s, %.1f MiB (%s)%s",
            adapter.name,
            adapter.rank,
            adapter.scaling,
            "/".join(m.removesuffix("_proj") for m in adapter.modules),
            adapter.nbytes / 2**20,
            adapter.path,
            ", pinned" if adapter.pinned else "",
        )
        return adapter

    def remove(self, name: str) -> bool:
        """Unregister `name`; running sequences on it finish on its slot. False when unknown."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            return False
        self._forget(adapter)
        log.info("LoRA adapter %s unloaded", name)
        return True

    def _forget(self, adapter: LoraAdapter) -> None:
        if adapter.key not in self.slots:
            self.by_key.pop(adapter.key, None)
            self.cpu.pop(adapter.key, None)
        adapter.pinned = False

    def _hold(self, adapter: LoraAdapter) -> None:
        """Put adapter's weights at the recent end of the CPU tier, dropping the least recent beyond it."""
        self.cpu[adapter.key] = None
        self.cpu.move_to_end(adapter.key)
        while len(self.cpu) > self.max_cpu_loras:
            victim = next((k for k in self.cpu if not self.by_key[k].pinned and k != adapter.key), None)
            if victim is None:
                break
            del self.cpu[victim]
            held = self.by_key.get(victim)
            if held is not None:
                held.weights = held.images = None
                self._event("evict_cpu", held.name)
                if victim not in self.slots and self.by_name.get(held.name) is not held:
                    del self.by_key[victim]

    # lookups

    def get(self, name: str) -> LoraAdapter:
        adapter = self.by_name.get(name)
        if adapter is None:
            raise LoraNotFound(f"the model {name!r} does not exist")
        return adapter

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def resident(self) -> tuple[int, int]:
        """(adapters in slots, adapters with weights in memory)."""
        return sum(k is not None for k in self.slots[1:]), len(self.cpu)

    def slot_of(self, key: str) -> int:
        """The slot holding `key`'s adapter; 0 for the base model ("")."""
        return self.slots.index(key) if key else 0

    # slots (the scheduler, between steps)

    def acquire(self, key: str, busy: set[str]) -> int | None:
        """A slot holding `key`'s adapter, placing it if needed in a free slot or in one whose adapter
        is not in `busy` (the keys running sequences use); None when every slot is busy. Raises
        LoraNotFound when the adapter is gone (unloaded and dropped)."""
        now = time.monotonic()
        if key in self.slots:
            slot = self.slots.index(key)
            self.slot_used[slot] = now
            return slot
        adapter = self.by_key.get(key)
        if adapter is None:
            raise LoraNotFound(f"the adapter {key.split(chr(0))[0].removeprefix('adapter=')!r} was unloaded")
        free = [s for s in range(1, len(self.slots)) if self.slots[s] is None]
        if not free:
            idle = [s for s in range(1, len(self.slots)) if self.slots[s] not in busy]
            if not idle:
                return None
            # least recently used first, pinned adapters' slots last
            idle.sort(key=lambda s: (self._pinned(self.slots[s]), self.slot_used[s]))
            free = idle[:1]
            self._evict_slot(free[0])
        slot = free[0]
        self._place(adapter, slot)
        self.slot_used[slot] = now
        return slot

    def _pinned(self, key: str | None) -> bool:
        adapter = self.by_key.get(key) if key else None
        return adapter is not None and adapter.pinned

    def _evict_slot(self, slot: int) -> None:
        key = self.slots[slot]
        self.slots[slot] = None
        if key is None:
            return
        adapter = self.by_key.get(key)
        if adapter is not None:
            self._event("evict_slot", adapter.name)
            if self.by_name.get(adapter.name) is not adapter:  # unloaded or replaced meanwhile
                del self.by_key[key]
                self.cpu.pop(key, None)

    def _place(self, adapter: LoraAdapter, slot: int) -> None:
        started = time.monotonic()
        if adapter.weights is None:  # dropped from the CPU tier: read again (rare; logged)
            log.warning("LoRA adapter %s: read again from %s for a slot", adapter.name, adapter.path)
            again = self.read(adapter.name, adapter.path)
            adapter.weights, adapter.images = again.weights, again.images
        if adapter.images is None:
            adapter.images = self.images(adapter)
        self._hold(adapter)
        images = adapter.images
        with torch.no_grad():
            for key, stack in self.stacks.items():
                stack.place(slot, images.get(key))
        self.slots[slot] = adapter.key
        log.debug(
            "LoRA adapter %s placed in slot %d in %.1f ms", adapter.name, slot, 1e3 * (time.monotonic() - started)
        )
