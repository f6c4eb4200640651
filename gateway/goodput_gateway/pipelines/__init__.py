"""InferencePipelines: several InferenceServices served as one model, with input and output guards.

`install` wires a pipeline server into the gateway; `start_watch` keeps its table current
from the cluster (`PipelineTable.load_files` serves pipelines from files instead).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from goodput_contract.api import GROUP, PIPELINE_PLURAL, VERSION
from goodput_gateway.discovery import Watch
from goodput_gateway.pipelines.metrics import PipelineMetrics
from goodput_gateway.pipelines.server import PipelineServer
from goodput_gateway.pipelines.table import PipelineTable
from goodput_operator.k8s import Kube

if TYPE_CHECKING:
    from goodput_gateway.app import Gateway

logger = logging.getLogger(__name__)

__all__ = ["PipelineServer", "PipelineTable", "install", "start_watch"]


def install(gateway: Gateway, table: PipelineTable) -> PipelineServer:
    """Requests whose model names a pipeline go to it; /v1/models lists pipelines beside services."""
    metrics = PipelineMetrics(gateway.metrics.registry)
    gateway.pipelines = PipelineServer(table, gateway.registry, gateway.proxy, metrics, gateway.keys)
    return gateway.pipelines


async def start_watch(kube: Kube, table: PipelineTable) -> list[Watch]:
    if not await kube.has_resource(f"{GROUP}/{VERSION}", PIPELINE_PLURAL):
        logger.warning("The cluster serves no InferencePipelines (crds/ not applied?): serving services only")
        table.synced = True
        return []
    return [
        Watch(
            kube, f"/apis/{GROUP}/{VERSION}/{PIPELINE_PLURAL}", "", asyncio.get_running_loop(), table.reset, table.event
        ).start()
    ]
