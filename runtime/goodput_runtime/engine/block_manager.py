"""Paged KV cache bookkeeping: fixed-size blocks, a free list, prefix sharing by block hash.

Pure Python. A block's hash chains its tokens with its parent block's hash (engine/prefix_digest.py:
a stable digest, its root salted with the model's identity and the sequence's LoRA adapter), so equal
hashes mean equal prefixes of the same model under the same adapter. Freed blocks keep their hash and
stay findable until they are handed out again, oldest first.

A request's choices (`n`) fork from one prefill: each takes a reference on every block of the
prompt. The partly filled last block is copied on write: the first choice to write into a block
others still hold gets a fresh copy of it (the copy is recorded on the sequence for the model
runner to make before the step), and the last holder writes in place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.sequence import Sequence


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The digest of a block of `tokens` after the prefix digested as `parent` (a sequence's root first)."""
    return prefix_digest.block_digest(parent, tokens)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_salt: str = ""
    ) -> None:
        self.block_size = block_size
        self.model_salt = model_salt  # prefix_digest.model_salt: the model's identity
        self._roots: dict[str, int] = {}  # a sequence's salt (its adapter's) -> its root digest
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # the KV offload tier (engine/kv_offload.py), when one is configured: evicted blocks with a
        # hash are copied there, and a prefix found there is loaded back instead of recomputed
        self.offload: Any = None  # an OffloadStore
        self.reload_policy: Any = None  # a ReloadPolicy
        self.pending_saves: list[tuple[int, int]] = []  # (block id, hash): copy out before the next step
        self.pending_loads: list[tuple[int, bytearray]] = []  # (block id, payload): copy in before the next step
        self.listeners: list[Any] = []  # (tier, hash, stored) on every device store and removal (kv_events.py)
        self.events: Any = None  # the KvEvents those go to, when they are published (kv_events.py)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def root(self, seq: Sequence) -> int:
        """The digest seq's first block chains from: the model's identity and seq's adapter."""
        salt = seq.cache_salt
        digest = self._roots.get(salt)
        if digest is None:
            if len(self._roots) > 4096:  # adapters come and go: keep the memo bounded
                self._roots.clear()
            digest = self._roots[salt] = prefix_digest.root(f"{self.model_salt}\0{salt}")
        return digest

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = self.root(seq)
        bs = self.block_size
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start : start + bs])
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def match_offloaded(self, seq: Sequence, num_hits: int) -> list[tuple[int, tuple[int, ...]]]:
        """The (hash, tokens) of seq's full blocks after its first `num_hits` (device hits) that the
        offload tier holds, leaving at least one token to compute; empty when loading them is
        predicted slower than prefilling them (ReloadPolicy)."""
        if self.offload is None or not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = self.root(seq)
        found: list[tuple[int, tuple[int, ...]]] = []
        for i, start in enumerate(range(0, seq.num_tokens - 1 - bs + 1, bs)):
            tokens = tuple(seq.token_ids[start : start + bs])
            h = block_hash(parent, tokens)
            parent = h
            if i < num_hits:
                continue
            if h in self.cached or not self.offload.contains(h):
                break
            found.append((h, tokens))
        if found and self.reload_policy is not None and not self.reload_policy.should_load(len(found), bs):
            self.offload.stats.declined_tokens += len(found) * bs
            return []
        return found

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix_hits: list[int] | None = None,
        loads: list[tuple[int, tuple[int, ...]]] | None = None,
    ) -> bool:
        """Give seq the blocks for num_new_tokens more computed tokens; False when they are not free.

        prefix_hits (from match_prefix, first admission only) become the head of its block table;
        loads (from match_offloaded, after the hits) follow them, each in a fresh block its payload is
        copied into before the next step. A load whose entry is gone or does not verify ends the loads
        there: its tokens and those after it are computed instead (fewer this step).
        """
        hits = prefix_hits or []
        loads = loads or []
        first = bool(hits or loads)
        computed = (len(hits) + len(loads)) * self.block_size if first else seq.num_computed_tokens
        have = len(hits) + len(loads) if first else len(seq.block_table)
        needed = self.blocks_needed(computed + num_new_tokens) - have
        reusable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        shared = self._shared_write_block(seq) if not first and num_new_tokens else None
        if needed + len(loads) + (shared is not None) > len(self.free) - reusable:
            return False
        if loads:
            return self._allocate_with_loads(seq, num_new_tokens, hits, loads)
        if shared is not None:  # copy on write: this sequence gets its own copy of the block
            source = seq.block_table[shared]
            self.blocks[source].ref_count -= 1
            seq.block_table[shared] = self._take_free()
            seq.block_copies.append((source, seq.block_table[shared]))
        if hits:
            for block_id in hits:
                self._take(block_id)
            seq.block_table = list(hits)
            seq.block_hashes = [self.blocks[b].hash for b in hits]  # type: ignore[misc]
            seq.num_computed_tokens = computed
        for _ in range(needed):
            seq.block_table.append(self._take_free())
        return True

    def _allocate_with_loads(
        self, seq: Sequence, num_new_tokens: int, hits: list[int], loads: list[tuple[int, tuple[int, ...]]]
    ) -> bool:
        for block_id in hits:
            self._take(block_id)
        table = list(hits)
        hashes: list[int] = [self.blocks[b].hash for b in hits]  # type: ignore[misc]
        assert self.offload is not None
        for h, tokens in loads:
            payload = self.offload.get(h)
            if payload is None:
                break
            block_id = self._take_free()
            block = self.blocks[block_id]
            block.hash, block.tokens = h, tokens
            self.cached[h] = block_id
            self._notify(h, True)
            self.pending_loads.append((block_id, payload))
            self.offload.stats.loaded_tokens += self.block_size
            table.append(block_id)
            hashes.append(h)
        seq.block_table, seq.block_hashes = table, hashes
        seq.num_computed_tokens = len(table) * self.block_size
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(table)):
            seq.block_table.append(self._take_free())
        return True

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, bytearray]]]:
        """The blocks to copy out to the offload tier and in from it before the next forward pass
        (saves first: a saved block may be handed out again and written this step)."""
        saves, loads = self.pending_saves, self.pending_loads
        self.pending_saves, self.pending_loads = [], []
        return saves, loads

    def _notify(self, h: int, stored: bool) -> None:
        for listener in self.listeners:
            listener("device", h, stored)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child share every block parent holds, its computed tokens and their hashes."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in seq's block table of the block its next token is written to, when other
        sequences hold it too."""
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1:
            return index
        return None

    def reserve(self, seq: Sequence, hits: list[int], count: int) -> list[int] | None:
        """A KV hand-off's blocks (kv_transfer/agent.py): seq takes the prefix hits (from match_prefix)
        and `count` fresh blocks after them for blocks pulled from another runtime; the fresh ones, or
        None when they are not free. Nothing counts as computed until the pulled blocks land."""
        reusable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if count > len(self.free) - reusable:
            return None
        for block_id in hits:
            self._take(block_id)
        fresh = [self._take_free() for _ in range(count)]
        seq.block_table = [*hits, *fresh]
        seq.block_hashes = [self.blocks[b].hash for b in hits]  # type: ignore[misc]
        return fresh

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (in reverse, so a prefix's tail is reused before its head)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def free_seq(self, seq: Sequence) -> None:
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.block_copies = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past seq's computed tokens: those allocated for proposed tokens the
        target rejected. They are fresh (no hash), so they go to the front of the free list."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def commit(self, seq: Sequence) -> None:
        """Publish seq's newly filled blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root(seq)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, tokens
                self.cached[h] = block.block_id
                if self.listeners:
                    self._notify(h, True)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                # a block loaded this very step holds no data yet: nothing to save, and its load is moot
                loading = any(b == block_id for b, _ in self.pending_loads)
                if loading:
                    self.pending_loads = [(b, p) for b, p in self.pending_loads if b != block_id]
                elif self.offload is not None and not self.offload.contains(block.hash):
                    self.pending_saves.append((block_id, block.hash))
                if self.listeners:
                    self._notify(block.hash, False)
            block.hash, block.tokens = None, ()
        block.ref_count = 1
        return block_id
