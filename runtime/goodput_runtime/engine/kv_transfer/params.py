"""The hand-off's fields as requests and answers carry them: ``kv_transfer_params``.

The name and shape are vLLM's (its NIXL connector's), so a gateway's two-phase routing drives a vLLM
fleet and this runtime alike. A prefill request carries ``{"do_remote_decode": true}``; its answer
carries the fields below with ``do_remote_prefill: true``, and the decode request carries that dict
back unchanged.

A peer pull (the gateway's, docs/kv-cache.md "Pulling a prefix from a peer") is the decode phase's
dict without a lease: ``remote_host``, ``remote_port``, ``block_digests`` and ``num_tokens`` (and
optionally ``layout_digest``, ``remote_engine_id``), no ``remote_request_id``. The blocks are looked up
by digest in the remote runtime's prefix cache, which holds them for its own requests.

The layout digest names what a block's bytes mean: the model's identity (the prefix digest's salt),
the cache's dtype, the number of layers, KV heads and head size, and the block size. Two runtimes
whose digests differ cannot exchange blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

DIGEST_HEX = 32  # a block's prefix digest (engine/prefix_digest.py) in hex
PEER_FIELDS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_host",
    "remote_port",
    "block_digests",
    "num_tokens",
    "layout_digest",
    "remote_engine_id",
}


def layout_digest(model_salt: str, dtype: str, layers: int, kv_heads: int, head_dim: int, block_size: int) -> str:
    text = f"{model_salt}\0dtype={dtype}\0layers={layers}\0kv_heads={kv_heads}\0head_dim={head_dim}\0block={block_size}"
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"goodput-layout").hexdigest()


class ParamsError(ValueError):
    """A kv_transfer_params the request cannot carry: the message names the part at fault."""


@dataclass(frozen=True, slots=True)
class HandoffParams:
    """What a prefill runtime returns and a decode runtime pulls by."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[int]
    num_tokens: int  # prompt tokens whose KV the blocks hold: len(remote_block_ids) full blocks
    layout_digest: str
    lease_seconds: float
    block_digests: list[str]  # the prefix digest of each block, hex

    @property
    def by_prefix(self) -> bool:
        """A peer pull: blocks found by digest in the remote runtime's prefix cache, under no lease."""
        return not self.remote_request_id

    def as_dict(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, **asdict(self)}

    @classmethod
    def parse(cls, value: dict[str, Any]) -> HandoffParams:
        """The decode phase's fields; ParamsError names the first that is missing or malformed."""

        def field(name: str, kind: type | tuple[type, ...]) -> Any:
            item = value.get(name)
            if not isinstance(item, kind) or isinstance(item, bool):
                raise ParamsError(f"'kv_transfer_params.{name}' is missing or of the wrong type")
            return item

        peer = "remote_request_id" not in value and "remote_block_ids" not in value
        if peer:
            unknown = sorted(set(value) - PEER_FIELDS)
            if unknown:
                raise ParamsError(f"'kv_transfer_params.{unknown[0]}' is not a field of a peer pull")
        ids = [] if peer else field("remote_block_ids", list)
        digests = field("block_digests", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ParamsError("'kv_transfer_params.remote_block_ids' must be a list of block ids")
        if (not peer and len(digests) != len(ids)) or not all(
            isinstance(d, str) and len(d) == DIGEST_HEX for d in digests
        ):
            raise ParamsError("'kv_transfer_params.block_digests' must hold one 32-hex digest per block")
        try:
            [int(d, 16) for d in digests]
        except ValueError:
            raise ParamsError("'kv_transfer_params.block_digests' must hold hex digests") from None
        port = field("remote_port", int)
        if not 0 < port < 65536:
            raise ParamsError("'kv_transfer_params.remote_port' must be a port number")
        num_tokens = field("num_tokens", int)
        if num_tokens < 0:
            raise ParamsError("'kv_transfer_params.num_tokens' must not be negative")
        if peer:
            if not digests:
                raise ParamsError("'kv_transfer_params.block_digests' of a peer pull must name a block")
            return cls(
                remote_engine_id=field("remote_engine_id", str) if "remote_engine_id" in value else "",
                remote_host=field("remote_host", str),
                remote_port=port,
                remote_request_id="",
                remote_block_ids=[],
                num_tokens=num_tokens,
                layout_digest=field("layout_digest", str) if "layout_digest" in value else "",
                lease_seconds=0.0,
                block_digests=list(digests),
            )
        return cls(
            remote_engine_id=field("remote_engine_id", str),
            remote_host=field("remote_host", str),
            remote_port=port,
            remote_request_id=field("remote_request_id", str),
            remote_block_ids=list(ids),
            num_tokens=num_tokens,
            layout_digest=field("layout_digest", str),
            lease_seconds=float(field("lease_seconds", (int, float))),
            block_digests=list(digests),
        )
