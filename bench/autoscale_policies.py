"""The scaling policies the simulator compares: the operator's own law, read through the signals it
would read off the pods, and a Kubernetes HPA on a per-pod metric."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from bench.autoscale_model import DT, Curve, Replica, Service
from goodput_operator.autoscaling.dispersion import DISPERSION_PERIODS, index_of_dispersion
from goodput_operator.autoscaling.law import decide
from goodput_operator.autoscaling.state import Observation, Policy, Signals, start_memory

PERIOD = 15.0  # control period of every autoscaler
WINDOW = 60.0  # metrics window the autoscalers read


def signals(
    svc: Service, now: float, arrived: deque[float], periods: deque[tuple[float, float]] | None = None
) -> Signals:
    """What the operator reads from the pods, here read off the simulated service. `periods`: the arrivals
    counted per control period so far (None: dispersion not measured, the law plans as for Poisson)."""
    recent = [f for f in svc.finished[-5000:] if f[0] > now - WINDOW]
    long_finished = [f for f in svc.finished[-20000:] if f[0] > now - 5 * WINDOW]
    long = [f[1] for f in long_finished]
    ttfts = sorted(f[2] for f in recent)
    tpots = sorted(f[3] for f in recent)
    ready = svc.ready(now)
    dispersion = index_of_dispersion(list(periods)) if periods is not None else None
    return Signals(
        arrival_rate=sum(1 for a in arrived if a > now - WINDOW) / min(WINDOW, max(now, DT)),
        arrival_rate_now=sum(1 for a in arrived if a > now - PERIOD) / min(PERIOD, max(now, DT)),
        attainment=sum(f[1] for f in recent) / len(recent) if recent else None,
        attainment_long=sum(long) / len(long) if long else None,
        finished_long=len(long),
        waiting=sum(len(r.queue) for r in ready),
        running=sum(len(r.running) for r in ready),
        ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        tpot_p90=tpots[int(0.9 * (len(tpots) - 1))] if tpots else None,
        finished=len(recent),
        dispersion=dispersion.index if dispersion else None,
        peakedness=dispersion.peakedness if dispersion else 1.0,
        size_cv2=spread(long_finished),
    )


def spread(finished: list[tuple[float, bool, float, float, float]]) -> float | None:
    """Request sizes' squared coefficient of variation as the operator reads it (dispersion.size_spread):
    the variance of the time after the first token over its mean squared, here from exact moments."""
    if len(finished) < 30:
        return None

    def moments(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / len(xs)

    (m1, v1), (m2, v2) = moments([f[4] for f in finished]), moments([f[2] for f in finished])
    return max(0.0, v1 - v2) / (m1 - m2) ** 2 if m1 > m2 else None


def goodput_policy(
    curve: Curve,
    low: int,
    high: int,
    target: float,
    capacity: float | None,
    startup: float = 60.0,
    dispersion: bool = True,
) -> Callable[..., int]:
    """The operator's law every PERIOD; `dispersion`: it measures the arrivals' index of dispersion from
    the counts per period, as the operator does (False: it is never read, and the law plans as for Poisson)."""
    policy = Policy(
        min_replicas=low,
        max_replicas=high,
        attainment_target=target,
        ttft_target=curve.slo_ttft,
        tpot_target=curve.slo_tpot,
        scale_down_window=120.0,
        startup_seconds=startup,
        window_seconds=WINDOW,
    )
    memory = start_memory(capacity)
    periods: deque[tuple[float, float]] = deque(maxlen=DISPERSION_PERIODS)

    def law(svc: Service, now: float, arrived: deque[float]) -> int:
        nonlocal memory
        periods.append((PERIOD, float(sum(1 for a in arrived if now - PERIOD < a <= now))))
        obs = Observation(
            now, len(svc.replicas), len(svc.ready(now)), signals(svc, now, arrived, periods if dispersion else None)
        )
        decision = decide(policy, obs, memory)
        memory = decision.memory
        return decision.desired

    return law


def hpa_policy(low: int, high: int, target: float, metric: Callable[[Replica], int]) -> Callable[..., int]:
    """A Kubernetes HPA (autoscaling/v2 behaviour) on a per-pod metric: 10 % tolerance, pods not ready
    counted as zero, scale-up max(4 pods, 100 %) per period, 300 s scale-down stabilisation."""
    history: deque[tuple[float, int]] = deque()

    def law(svc: Service, now: float, arrived: deque[float]) -> int:
        current = len(svc.replicas)
        total = sum(metric(r) for r in svc.ready(now))
        ratio = total / max(1, current) / target
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(total / target)
        want = max(low, min(high, want))
        history.append((now, want))
        while history and history[0][0] < now - 300:
            history.popleft()
        if want > current:
            return min(want, current + max(4, current))
        return min(current, max(w for _, w in history))

    return law
