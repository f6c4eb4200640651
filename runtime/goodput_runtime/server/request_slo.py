"""A request's own SLO: the TTFT and TPOT targets it carries in headers, which admission (admission.py) and
the goodput counters judge it by instead of the server's --slo-ttft and --slo-tpot.

The gateway sends ``x-goodput-slo-ttft-ms`` and ``x-goodput-slo-tpot-ms`` (a client's own, else its
tenant's defaults); llm-d's ``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` are read too, after ours.
Each is a positive number of milliseconds; anything else is a 400 naming the header.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import invalid
from goodput_runtime.server.fields import shown

TTFT_HEADERS = ("x-goodput-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-goodput-slo-tpot-ms", "x-llm-d-slo-tpot-ms")


@dataclass(frozen=True, slots=True)
class RequestSLO:
    """A request's targets, seconds; None: the server's."""

    ttft: float | None = None
    tpot: float | None = None

    @property
    def own(self) -> bool:
        return self.ttft is not None or self.tpot is not None


def header_seconds(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = headers.get(name)
        if value is None:
            continue
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise invalid(f"The header {name} must be a positive number of milliseconds, got {shown(value)}", name)
        return ms / 1000
    return None


def request_slo(headers: Mapping[str, str]) -> RequestSLO:
    """The request's own targets from its headers (400 naming a header that is not a positive number)."""
    return RequestSLO(header_seconds(headers, TTFT_HEADERS), header_seconds(headers, TPOT_HEADERS))


def with_slo(params: SamplingParams, slo: RequestSLO) -> SamplingParams:
    """params carrying the request's own targets, which its goodput is judged by when it finishes."""
    if not slo.own:
        return params
    return dataclasses.replace(params, slo_ttft=slo.ttft, slo_tpot=slo.tpot)
