"""How long a replica takes to start, as the autoscaler sees it: replicas asked for → ready.

Pure, fed once per control period with the replica count the scale subresource holds and
the ready endpoints. Each replica slot above the ready count is stamped when it is first
wanted; when the ready count reaches the slot, the time since is a sample (it includes
scheduling, image pull and weight load: what the forecast must look ahead by). A slot
given up before it became ready is dropped. Samples are averaged exponentially. The
operator has no access to pods, so this is measured from the EndpointSlices it reads;
it is late by at most one period.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT = 0.3  # of the newest sample in the average


@dataclass
class StartupClock:
    seconds: float | None = None  # the averaged start-up time; None until a first replica has started
    samples: int = 0
    _wanted_since: dict[int, float] = field(default_factory=dict)  # replica slot (1-based) → first wanted

    def observe(self, now: float, current: int, ready: int) -> float | None:
        for slot in [s for s in self._wanted_since if s > current]:
            del self._wanted_since[slot]  # scaled down before it started
        for slot in range(ready + 1, current + 1):
            self._wanted_since.setdefault(slot, now)
        for slot in [s for s in self._wanted_since if s <= ready]:
            sample = now - self._wanted_since.pop(slot)
            self.seconds = sample if self.seconds is None else WEIGHT * sample + (1 - WEIGHT) * self.seconds
            self.samples += 1
        return self.seconds
