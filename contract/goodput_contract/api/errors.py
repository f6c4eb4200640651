"""SpecError: what every spec parser raises, naming the field the user has to fix."""

from __future__ import annotations


class SpecError(ValueError):
    """An invalid spec; `field` is the dotted path the user has to fix, e.g. spec.slo.ttft."""

    def __init__(self, field_path: str, message: str, reason: str = "InvalidSpec") -> None:
        self.field = field_path if field_path.startswith("metadata.") else f"spec.{field_path}"
        self.reason = reason
        super().__init__(f"{self.field}: {message}")
