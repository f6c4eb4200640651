"""Shared by the scaling law's tests: a policy, a known capacity, and a minute that met or missed the SLO."""

from goodput_operator.autoscaling.state import Memory, Policy, Signals

POLICY = Policy(
    min_replicas=1, max_replicas=10, attainment_target=0.95, ttft_target=0.5, tpot_target=0.05, scale_down_window=300
)
KNOWN = Memory(capacity_per_replica=4.0)  # requests per second per replica


def met(rate: float, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.99, **kw)


def missed(rate: float, waiting: int = 12, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.80, waiting=waiting, ttft_p90=0.71, **kw)
