"""The ``kv_transfer_params`` request field: which phase of a KV hand-off a request is, checked against
this runtime's ``--kv-transfer-role`` (engine/kv_transfer/).

- ``{"do_remote_decode": true}``: the prefill phase (role ``prefill`` or ``both``). One choice, not
  streamed; the answer carries the hand-off's fields as a top-level ``kv_transfer_params``.
- ``{"do_remote_prefill": true, ...}``: the decode phase (role ``decode`` or ``both``), the prefill
  phase's answer sent back unchanged.
- both flags false (vLLM's way of saying no hand-off): a plain request.

Anything else, or a phase the role does not allow, is a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput_runtime.engine.kv_transfer.params import HandoffParams, ParamsError
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import APIError, invalid

FIELD = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class KVTransferRequest:
    role: str  # prefill: keep the prompt's blocks under a lease; decode: pull them first
    handoff: HandoffParams | None = None  # the decode phase's

    @property
    def remote_tokens(self) -> int:
        """Prompt tokens the hand-off brings: what admission does not count as computed here."""
        return self.handoff.num_tokens if self.handoff is not None else 0


def kv_transfer_failed(message: str) -> APIError:
    """A decode phase whose hand-off failed under --kv-failure-policy fail."""
    return APIError(503, message, "kv_transfer_failed", FIELD, "kv_transfer_failed", headers={"Retry-After": "1"})


def parse_kv_transfer(value: Any, engine: Any, params: SamplingParams, stream: bool) -> KVTransferRequest | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{FIELD}' must be an object", FIELD, "invalid_type")
    agent = getattr(engine, "kv_transfer", None)
    role = agent.role if agent is not None else "none"
    decode, prefill = value.get("do_remote_decode"), value.get("do_remote_prefill")
    if not isinstance(decode, bool | None) or not isinstance(prefill, bool | None):
        raise invalid(f"'{FIELD}.do_remote_decode' and '.do_remote_prefill' must be booleans", FIELD, "invalid_type")
    if not decode and not prefill:
        return None
    if role == "none":
        raise invalid(
            f"'{FIELD}' is not accepted: this runtime takes no part in KV hand-offs (--kv-transfer-role none)", FIELD
        )
    if decode and prefill:
        raise invalid(f"'{FIELD}' cannot ask for both a remote decode and a remote prefill", FIELD)
    if decode:
        if role not in ("prefill", "both"):
            raise invalid(f"'{FIELD}.do_remote_decode' is not accepted: this runtime's role is {role}", FIELD)
        if params.n != 1 or stream:
            raise invalid(f"'{FIELD}.do_remote_decode' needs n 1 and stream false (the prefill phase)", FIELD)
        return KVTransferRequest("prefill")
    if role not in ("decode", "both"):
        raise invalid(f"'{FIELD}.do_remote_prefill' is not accepted: this runtime's role is {role}", FIELD)
    if params.prompt_logprobs is not None:
        raise invalid(f"'{FIELD}' cannot be combined with 'prompt_logprobs': they need every prompt position", FIELD)
    try:
        return KVTransferRequest("decode", HandoffParams.parse(value))
    except ParamsError as exc:
        raise invalid(str(exc), FIELD) from None
