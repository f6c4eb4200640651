"""KV hand-off between runtimes: a prefill runtime computes a prompt and keeps its KV blocks under a
lease; a decode runtime pulls the blocks it lacks, recomputes the rest and decodes.

- params.py: the hand-off's fields (``kv_transfer_params``, vLLM's name and shape) and the layout digest;
- leases.py: the prefill side's leases on a finished prompt's blocks;
- base.py: the transport interface (pull and release, and the side that serves them);
- local.py and tcp.py: the transports (in process; asyncio TCP with a framed protocol);
- agent.py: the engine's side of both roles: leases, serving pulls, pulling and landing blocks;
- metrics.py: transfers, bytes, seconds, failures, leased blocks, lease expiries.
"""

from goodput_runtime.engine.kv_transfer.base import KVTransferError
from goodput_runtime.engine.kv_transfer.params import HandoffParams, layout_digest

__all__ = ["HandoffParams", "KVTransferError", "layout_digest"]
