"""Kubernetes resource quantities ("64Gi", "500m", "1.5e9") as numbers."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?P<suffix>[a-zA-Z]*|[eE][+-]?[0-9]+)$")

# The same grammar, for the CRD schema's `pattern` fields.
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"


def parse_quantity(value: str | int | float) -> Decimal:
    """The quantity's value in base units (bytes, cores); ValueError if it is not one."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a quantity")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a quantity") from None
    suffix = match["suffix"]
    try:
        if suffix in _BINARY:
            return number * _BINARY[suffix]
        if suffix in _DECIMAL:
            return number * _DECIMAL[suffix]
        if suffix[:1] in ("e", "E"):
            return number * (Decimal(10) ** int(suffix[1:]))
    except ArithmeticError:  # an exponent beyond Decimal's range, such as 1e1000000
        raise ValueError(f"{value!r} is out of range") from None
    raise ValueError(f"{value!r} has an unknown suffix {suffix!r}")


def quantity_bytes(value: str | int | float) -> int:
    return int(parse_quantity(value))
