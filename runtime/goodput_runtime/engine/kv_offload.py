"""The KV offload tier: blocks evicted from the KV cache, kept on local disk, loaded back on a hit.

A block the block manager hands out again loses its keys and values; when it carries a prefix
digest (engine/prefix_digest.py: model- and adapter-salted, stable across processes) the model
runner first copies its rows out of the cache, in the step that evicts it and before that step's
forward pass writes anything, and hands the copy to this tier's writer thread. Everything slower
than that copy (serialising, checksumming, writing) happens on the writer thread, off the step loop;
when the writer falls behind, saves are dropped (a miss later, never a stall now).

Storage: one file of fixed-size slots under a directory on local disk, at most ``capacity`` bytes
(``--kv-offload-bytes``), least recently used entries evicted first. Each slot starts with a header
(the block's digest, the payload's CRC-32 and length) followed by the payload: every layer's keys,
then every layer's values, of the block's tokens. Reads and writes are ``pread``/``pwrite`` through
the page cache (memory speed while the file fits in memory, local-disk speed past it). The file is
not ``mmap``-ed: a file truncated under a mapping kills the process with SIGBUS on the next read,
where ``pread`` returns short and the entry is detected as truncated.

A read is served only when the header names the digest asked for and the payload's length and
CRC-32 match what was written; otherwise the entry is dropped and the prefix recomputed.

Whether to load or recompute is decided per request: the tier measures its reload throughput
(bytes per second, read and verified, and copied into the cache) and the scheduler reports its
prefill throughput (prompt tokens per second); a run of blocks found in the tier is loaded when its
predicted load time is below the predicted prefill time of the same tokens.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HEADER = struct.Struct("<16sIQ")  # digest, CRC-32 of the payload, payload length
WRITE_QUEUE = 1024  # saves waiting for the writer thread; beyond it a save is dropped
EWMA = 0.2  # weight of the newest throughput sample


@dataclass
class OffloadStats:
    stored_blocks: int = 0  # entries written
    evicted_blocks: int = 0  # entries dropped for room (LRU)
    dropped_saves: int = 0  # saves not written: the writer's queue was full
    hits: int = 0  # blocks served
    misses: int = 0  # lookups of entries found gone at read time
    corrupt: int = 0  # entries whose header, length or checksum did not match: dropped, recomputed
    offload_bytes: int = 0
    offload_seconds: float = 0.0  # on the writer thread
    save_copy_seconds: float = 0.0  # on the step: evicted blocks copied out of the cache for the writer
    reload_bytes: int = 0
    reload_seconds: float = 0.0  # read, verify and copy into the cache
    loaded_tokens: int = 0  # prompt tokens served from the tier instead of prefilled
    declined_tokens: int = 0  # tokens found in the tier but recomputed: predicted faster


class OffloadStore:
    """A byte-bounded LRU of KV blocks by prefix digest, in one file of fixed-size slots."""

    def __init__(self, directory: str | None, capacity: int, entry_bytes: int) -> None:
        self.entry_bytes = entry_bytes
        self.slot_bytes = HEADER.size + entry_bytes
        self.num_slots = capacity // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"the KV offload tier of {capacity} bytes holds no block of {self.slot_bytes} bytes (with its header)"
            )
        self.capacity = capacity
        if directory:
            os.makedirs(directory, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="goodput-kv-", suffix=".blocks", dir=directory or None)
        self.fd = fd
        self.lock = threading.Lock()
        self.index: OrderedDict[int, int] = OrderedDict()  # digest -> slot, least recently used first
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.writing: set[int] = set()  # slots being written: neither readable nor reusable yet
        self.stats = OffloadStats()
        # (tier, digest, stored): called on the thread that stores or removes (kv_events.py)
        self.listeners: list[Callable[[str, int, bool], None]] = []
        self.queue: queue.Queue[tuple[int, object] | None] = queue.Queue(WRITE_QUEUE)
        self.closed = False
        self.writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self.writer.start()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots holding an entry or being written: at most `capacity`."""
        with self.lock:
            return (len(self.index) + len(self.writing)) * self.slot_bytes

    def __len__(self) -> int:
        with self.lock:
            return len(self.index)

    def contains(self, digest: int) -> bool:
        with self.lock:
            return digest in self.index

    def digests(self) -> list[int]:
        with self.lock:
            return list(self.index)

    # -- writes ----------------------------------------------------------------------------------

    def save_async(self, digest: int, payload: object) -> bool:
        """Queue `payload` (bytes, or anything with ``numpy()`` or the buffer protocol) for the
        writer; False when the queue is full and the save is dropped."""
        try:
            self.queue.put_nowait((digest, payload))
            return True
        except queue.Full:
            with self.lock:
                self.stats.dropped_saves += 1
            return False

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (at most `timeout` seconds) until every queued save is written."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def put(self, digest: int, payload: object) -> None:
        """Write one entry now (the writer thread calls this)."""
        data = _as_bytes(payload)
        if len(data) != self.entry_bytes:
            raise ValueError(f"a KV block of {len(data)} bytes; this tier stores {self.entry_bytes}")
        started = time.perf_counter()
        evicted: list[int] = []
        with self.lock:
            if self.closed or digest in self.index:
                return
            if not self.free_slots:
                old = next((d for d, s in self.index.items() if s not in self.writing), None)
                if old is None:
                    return  # every entry is being read
                slot = self.index.pop(old)
                self.stats.evicted_blocks += 1
                evicted.append(old)
            else:
                slot = self.free_slots.pop()
            self.writing.add(slot)
        for old in evicted:
            self._notify(old, False)
        header = HEADER.pack(digest.to_bytes(16, "little"), zlib.crc32(data), len(data))
        try:
            os.pwritev(self.fd, [header, data], slot * self.slot_bytes)
        except OSError:
            log.exception("KV offload: writing a block failed; it is not kept")
            with self.lock:
                self.writing.discard(slot)
                self.free_slots.append(slot)
            return
        with self.lock:
            self.writing.discard(slot)
            if self.closed:
                return
            self.index[digest] = slot
            self.stats.stored_blocks += 1
            self.stats.offload_bytes += len(data)
            self.stats.offload_seconds += time.perf_counter() - started
        self._notify(digest, True)

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                digest, payload = item
                self.put(digest, payload)
            except Exception:
                log.exception("KV offload: a save failed")
            finally:
                self.queue.task_done()

    # -- reads -----------------------------------------------------------------------------------

    def get(self, digest: int) -> bytearray | None:
        """The entry's payload, verified; None when it is gone or does not verify (then dropped)."""
        started = time.perf_counter()
        with self.lock:
            slot = self.index.get(digest)
            if slot is None:
                self.stats.misses += 1
                return None
            self.index.move_to_end(digest)
            self.writing.add(slot)  # not reused while it is read
        header = bytearray(HEADER.size)
        payload: bytearray | None = bytearray(self.entry_bytes)
        try:
            got = os.preadv(self.fd, [header, payload], slot * self.slot_bytes)  # type: ignore[list-item]
        except OSError:
            got = 0
        finally:
            with self.lock:
                self.writing.discard(slot)
        if not self._verify(header, payload, got, digest):  # type: ignore[arg-type]
            payload = None
        with self.lock:
            if payload is None:
                self.stats.corrupt += 1
                if self.index.get(digest) == slot:
                    del self.index[digest]
                    self.free_slots.append(slot)
            else:
                self.stats.hits += 1
                self.stats.reload_bytes += len(payload)
                self.stats.reload_seconds += time.perf_counter() - started
        if payload is None:
            log.warning("KV offload: the entry of block %032x is truncated or corrupt; recomputing it", digest)
            self._notify(digest, False)
        return payload

    def _verify(self, header: bytearray, payload: bytearray, got: int, digest: int) -> bool:
        """Whether a read of `got` bytes gave the whole entry of `digest`, unchanged."""
        if got != self.slot_bytes:
            return False  # truncated
        stored, crc, length = HEADER.unpack_from(header)
        if stored != digest.to_bytes(16, "little") or length != self.entry_bytes:
            return False
        return zlib.crc32(payload) == crc

    def observe_save_copy(self, seconds: float) -> None:
        """Seconds a step spent copying evicted blocks out of the cache for the writer: the tier's
        only cost on the step loop."""
        with self.lock:
            self.stats.save_copy_seconds += seconds

    def observe_copy(self, seconds: float) -> None:
        """Seconds the runner spent copying loaded blocks into the cache: part of a reload's cost."""
        with self.lock:
            self.stats.reload_seconds += seconds

    # -- lifecycle -------------------------------------------------------------------------------

    def clear(self) -> None:
        with self.lock:
            removed = list(self.index)
            self.index.clear()
            self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in self.writing]
        for digest in removed:
            self._notify(digest, False)

    def close(self) -> None:
        if self.closed:
            return
        self.flush(5.0)
        with self.lock:
            self.closed = True
            self.index.clear()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self.writer.join(timeout=5.0)
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _notify(self, digest: int, stored: bool) -> None:
        for listener in self.listeners:
            try:
                listener("offload", digest, stored)
            except Exception:
                log.exception("KV offload: an event listener failed")


def _as_bytes(payload: object) -> bytes | bytearray | memoryview:
    if isinstance(payload, bytes | bytearray | memoryview):
        return payload
    numpy = getattr(payload, "numpy", None)
    if numpy is not None:  # a CPU tensor: its bytes, without a copy
        return memoryview(numpy()).cast("B")
    return memoryview(payload).cast("B")  # type: ignore[arg-type]


class ReloadPolicy:
    """Load a run of offloaded blocks only when that is predicted faster than prefilling its tokens.

    Both rates are measured in the process: the tier's reload throughput (bytes/s, read, verified and
    copied) and the prefill throughput of steps that were mostly prompt (tokens/s). Until both are
    measured, a hit is loaded (which is what measures the first)."""

    def __init__(self, store: OffloadStore) -> None:
        self.store = store
        self.prefill_tokens_per_s: float | None = None
        self.seen_reload = (0, 0.0)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < 32 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - EWMA) * old + EWMA * rate

    def reload_bytes_per_s(self) -> float | None:
        s = self.store.stats
        if s.reload_bytes < self.store.entry_bytes * 4 or s.reload_seconds <= 0:
            return None
        return s.reload_bytes / s.reload_seconds

    def should_load(self, num_blocks: int, block_size: int) -> bool:
        reload_rate = self.reload_bytes_per_s()
        if reload_rate is None or self.prefill_tokens_per_s is None:
            return True
        load_s = num_blocks * self.store.entry_bytes / reload_rate
        prefill_s = num_blocks * block_size / self.prefill_tokens_per_s
        return load_s < prefill_s


__all__ = ["OffloadStats", "OffloadStore", "ReloadPolicy"]
