"""InferencePipelines: several InferenceServices served as one model, with input and output guards.

`PipelineServer` answers the requests whose model names a pipeline (`__main__` builds it and
hands it to the gateway); `start_watch` keeps its table current from the cluster
(`PipelineTable.load_files` serves pipelines from files instead).
"""

from __future__ import annotations

import logging

from goodput_contract.api import GROUP, PIPELINE_PLURAL, VERSION
from goodput_gateway.pipelines.metrics import PipelineMetrics
from goodput_gateway.pipelines.server import PipelineServer
from goodput_gateway.pipelines.table import PipelineTable
from goodput_gateway.watch import Watch
from goodput_operator.k8s import Kube

logger = logging.getLogger(__name__)

__all__ = ["PipelineMetrics", "PipelineServer", "PipelineTable", "start_watch"]


async def start_watch(kube: Kube, table: PipelineTable) -> list[Watch]:
    if not await kube.has_resource(f"{GROUP}/{VERSION}", PIPELINE_PLURAL):
        logger.warning("The cluster serves no InferencePipelines (crds/ not applied?): serving services only")
        table.fill({})
        return []
    return [Watch(kube, f"/apis/{GROUP}/{VERSION}/{PIPELINE_PLURAL}", "", table).start()]
