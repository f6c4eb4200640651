"""The command line's value types and refusals: sizes, durations, bounded numbers, ports, adapters;
the parser that writes why a command line was refused to the termination message file."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

from goodput_runtime.config import EngineConfig

BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
log = logging.getLogger("goodput_runtime")
N = TypeVar("N", int, float)
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_BYTES = 4000  # Kubernetes keeps 4 KiB of it


def write_termination_message(path: str, reason: str) -> None:
    """Why the runtime exits, in one line, where Kubernetes shows it (``kubectl describe pod``).

    Writes only to an existing regular file, or a new file in an existing directory other than
    /dev, so on a host outside Kubernetes the default path creates nothing. Never raises.
    """
    try:
        target = Path(path)
        if not (
            target.is_file()
            or (not target.exists() and target.parent.is_dir() and target.parent.resolve() != Path("/dev"))
        ):
            return
        line = " ".join(reason.split()).encode()[:TERMINATION_MESSAGE_BYTES].decode(errors="ignore")
        target.write_text(line + "\n")
    except Exception as exc:  # a reason we cannot record must not hide the real exit
        log.warning("Cannot write the termination message to %s: %s", path, exc)


def termination_message_path(argv: list[str] | None) -> str:
    """``--termination-message-path`` from a command line that may not parse as a whole."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--termination-message-path", default=TERMINATION_MESSAGE_PATH)
    try:
        known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    except (argparse.ArgumentError, SystemExit):
        return TERMINATION_MESSAGE_PATH
    return str(known.termination_message_path)


class ReasonedArgumentParser(argparse.ArgumentParser):
    """Writes why the command line was refused to the termination message file, then exits 2."""

    termination_path = TERMINATION_MESSAGE_PATH

    def error(self, message: str) -> NoReturn:
        write_termination_message(self.termination_path, f"Invalid arguments: {message}")
        super().error(message)


def default(name: str):
    return EngineConfig.__dataclass_fields__[name].default


def byte_size(text: str) -> int:
    """``536870912``, ``512Mi``, ``2Gi``, ``1.5G`` (Kubernetes quantity suffixes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGgTt]i?|[Bb])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 536870912, 512Mi, 2Gi)")
    value = float(match.group(1)) * BYTE_UNITS[(match.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte: {text!r}")
    return int(value)


def seconds(text: str) -> float:
    """``0.5``, ``0.5s`` or ``500ms``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration in seconds: {text!r} (examples: 0.5, 500ms)")
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it has one; unset flags explain themselves in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than zero: {text!r}")
    return value


def bounded(
    parse: Callable[[str], N], kind: str, low: N, high: N | None = None, low_open: bool = False, high_open: bool = False
) -> Callable[[str], N]:
    """An argparse type: the text as `parse` reads it ("not <kind>" where it cannot), at least `low` (more
    than it where `low_open`) and at most `high` (less than it where `high_open`)."""
    if high is None:
        bounds = f"{'more than' if low_open else 'at least'} {low:g}"
    else:
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be {bounds}: {text!r}")
        return value

    return check


positive_int = bounded(int, "an integer", 1)
non_negative_int = bounded(int, "an integer", 0)
fraction = bounded(float, "a number", 0.0, 1.0, low_open=True)
margin_fraction = bounded(float, "a number", 0.0, 1.0, high_open=True)


def port_number(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return value


def lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH of --lora-modules."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path
