"""Output rules on a stream: generated text is held back by a window before the client sees it.

The filter releases text only once it lies `hold_back` characters behind the newest text,
so a match up to `hold_back` characters long is complete, wherever the chunk boundaries
fell, before any of it is released. A redacting match still reaching into the window holds
the release at its start until it is complete. A blocking match ends the stream: the text
before it is released, the rest never is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput_gateway.pipelines.rules import MAX_LENGTH_RULE, RuleSet, redact


@dataclass
class Release:
    text: str  # safe to send now
    blocked_by: str | None = None  # set once: the stream must end with finish_reason content_filter
    redacted: tuple[str, ...] = ()


@dataclass
class OutputFilter:
    rules: RuleSet
    hold_back: int
    pending: str = ""  # received, not yet released
    released_chars: int = 0
    blocked_by: str | None = None
    redacted: set[str] = field(default_factory=set)

    def feed(self, delta: str) -> Release:
        if self.blocked_by:
            return Release("", self.blocked_by)
        self.pending += delta
        return self._release(final=False)

    def finish(self) -> Release:
        if self.blocked_by:
            return Release("", self.blocked_by)
        return self._release(final=True)

    def _release(self, final: bool) -> Release:
        pending = self.pending
        limit = self.rules.max_length
        if limit is not None and self.released_chars + len(pending) > limit:
            pending = pending[: limit - self.released_chars]
            self.blocked_by = MAX_LENGTH_RULE
        found = self.rules.matches(pending)
        blocking = next((m for m in found if m.block), None)
        if blocking:
            self.blocked_by = blocking.rule
            found = [m for m in found if m.end <= blocking.start]
            return self._emit(pending, blocking.start, found, consumed_all=True)
        if self.blocked_by:  # the length limit: release up to it, then end
            return self._emit(pending, len(pending), found, consumed_all=True)
        cut = len(pending) if final else max(0, len(pending) - self.hold_back)
        for m in found:
            if m.end > cut:
                cut = min(cut, m.start)
        return self._emit(pending, cut, [m for m in found if m.end <= cut], consumed_all=False)

    def _emit(self, pending: str, cut: int, found: list, consumed_all: bool) -> Release:
        text = redact(pending[:cut], found)
        names = tuple(dict.fromkeys(m.rule for m in found))
        self.redacted.update(names)
        self.released_chars += cut
        self.pending = "" if consumed_all else self.pending[cut:]
        return Release(text, self.blocked_by, names)
