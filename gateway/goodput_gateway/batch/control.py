"""How many batch lines a service may have in flight: additive increase, multiplicative decrease.

Every period each ready replica's /metrics is read for the online (priority 0) requests
waiting and the online requests that met the SLO since the last read. While online attainment
holds and no online queue persists (online requests waiting at two reads in a row: one waiting
at a single read is most often a request that arrived during the step and joins the next), the
limit grows by `increase` per period, up to `per_replica_cap` per ready replica; otherwise it is
cut by `decrease`, down to one line.
A replica that exports no per-priority series (another engine) is judged by its total
queue: any waiting request counts as online pressure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput_contract import metrics as names


@dataclass
class ReplicaSignals:
    online_waiting: float = 0.0
    online_total: float = 0.0
    online_good: float = 0.0
    seen: bool = False  # the per-priority series were present


def parse_signals(text: str) -> ReplicaSignals:
    signals = ReplicaSignals()
    total_waiting = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        online = 'priority="online"' in line
        if name in (names.REQUESTS_WAITING, "vllm:num_requests_waiting", "sglang:num_queue_reqs"):
            total_waiting += value
        elif name == names.REQUESTS_WAITING_BY_PRIORITY:
            signals.seen = True
            if online:
                signals.online_waiting += value
        elif name == names.REQUESTS_BY_PRIORITY and online:
            signals.online_total += value
        elif name == names.REQUESTS_GOOD_BY_PRIORITY and online:
            signals.online_good += value
    if not signals.seen:
        signals.online_waiting = total_waiting
    return signals


@dataclass
class AIMD:
    target_attainment: float = 0.99
    increase: float = 1.0
    decrease: float = 0.5
    per_replica_cap: int = 32
    limit: float = 1.0
    last: dict[str, ReplicaSignals] = field(default_factory=dict)
    queued: bool = False  # online requests waited at the previous read

    def update(self, current: dict[str, ReplicaSignals], in_flight: int | None = None) -> float:
        """Adjust the limit from the replicas' latest signals (url -> signals); return it. The limit
        grows only while it binds (`in_flight` lines reach it; None: assume so): an idle service's
        limit does not climb to the cap and let the next batch in all at once."""
        waiting = sum(s.online_waiting for s in current.values())
        total = good = 0.0
        for url, now in current.items():
            before = self.last.get(url)
            if before is not None and now.online_total >= before.online_total:
                total += now.online_total - before.online_total
                good += now.online_good - before.online_good
        self.last = dict(current)
        attainment = good / total if total > 0 else None
        cap = max(1, self.per_replica_cap * len(current))
        persistent_queue, self.queued = waiting > 0 and self.queued, waiting > 0
        if persistent_queue or (attainment is not None and attainment < self.target_attainment):
            self.limit = max(1.0, self.limit * self.decrease)
        elif in_flight is None or in_flight >= int(self.limit):
            self.limit = min(float(cap), self.limit + self.increase)
        self.limit = min(self.limit, float(cap))
        return self.limit
