"""The gateway exports every pipeline series the contract names, in its own registry."""

from goodput_contract import metrics as names
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipelines.metrics import PipelineMetrics


def test_the_gateway_exports_every_pipeline_series_the_contract_names():
    gateway = GatewayMetrics()
    metrics = PipelineMetrics(gateway.registry)
    metrics.seen("ns", "safe-chat")
    metrics.ttft.labels("ns", "safe-chat").observe(0.2)
    metrics.step.labels("ns", "safe-chat", "input-rules", "guard").observe(0.0001)
    metrics.blocks.labels("ns", "safe-chat", "pii-card").inc()
    metrics.redactions.labels("ns", "safe-chat", "pii-email").inc()
    exported = {sample.name for family in gateway.registry.collect() for sample in family.samples}
    series = {
        value
        for key, value in vars(names).items()
        if key.isupper()
        and isinstance(value, str)
        and value.startswith((names.PREFIX + "pipeline_", names.PREFIX + "guard_"))
    }
    assert len(series) == 6
    histograms = {names.PIPELINE_TTFT, names.PIPELINE_STEP_DURATION}
    for name in series:
        assert (name + "_count" if name in histograms else name) in exported, name
    outcomes = {
        s.labels["outcome"] for f in gateway.registry.collect() for s in f.samples if s.name == names.PIPELINE_REQUESTS
    }
    assert outcomes == set(names.PIPELINE_OUTCOMES)  # every outcome's series exists at zero from the start
