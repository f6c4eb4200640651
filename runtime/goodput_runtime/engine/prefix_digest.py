"""Prefix-cache identity: a stable digest of a block's tokens and everything before them.

A block's digest is BLAKE2b (16 bytes) over its parent block's digest and its token ids (each as
four little-endian bytes). The first block's parent is the sequence's root: the digest of a salt
naming the model (its name or path, revision and KV dtype) and, for a request on a LoRA adapter, the
adapter's name and the digest of its weights. So

- equal digests mean an equal prefix, of the same model, under the same adapter: the same prompt
  on the base model and on an adapter (or on an adapter reloaded under its name with new weights)
  never shares KV blocks;
- the digest depends on nothing in the process (unlike Python's ``hash``, salted per process for
  strings and bytes), so two processes serving the same model compute the same digest for the same
  prefix: what a KV hand-off between processes or a shared KV tier can key blocks on.

Digests are Python ints (128 bits) in memory; ``to_bytes`` gives the 16 bytes that go on the wire.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16


def _tokens_bytes(tokens: tuple[int, ...] | list[int]) -> bytes:
    data = array("I", tokens)  # uint32: every vocabulary fits
    if data.itemsize != 4:  # pragma: no cover - every platform CPython runs on has a 4-byte unsigned int
        data = array("L", tokens)
    if array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - big-endian hosts
        data.byteswap()
    return data.tobytes()


def root(salt: str) -> int:
    """The root digest of a sequence whose cache identity is `salt` (model, then adapter)."""
    return int.from_bytes(
        hashlib.blake2b(salt.encode(), digest_size=DIGEST_BYTES, person=b"goodput-root").digest(), "little"
    )


def block_digest(parent: int, tokens: tuple[int, ...] | list[int]) -> int:
    """The digest of a block holding `tokens` after the prefix whose digest is `parent` (a root for
    the first block)."""
    h = hashlib.blake2b(parent.to_bytes(DIGEST_BYTES, "little"), digest_size=DIGEST_BYTES, person=b"goodput-block")
    h.update(_tokens_bytes(tokens))
    return int.from_bytes(h.digest(), "little")


def to_bytes(digest: int) -> bytes:
    return digest.to_bytes(DIGEST_BYTES, "little")


def model_salt(model: str, revision: str | None, kv_dtype: str) -> str:
    """The model's part of the salt: what the cached keys and values depend on besides the tokens."""
    return f"model={model}\0revision={revision or ''}\0kv={kv_dtype}"


def adapter_salt(adapter: str, adapter_digest: str) -> str:
    """A LoRA adapter's part of the salt: its name and the digest of its weights."""
    return f"adapter={adapter}\0weights={adapter_digest}"
