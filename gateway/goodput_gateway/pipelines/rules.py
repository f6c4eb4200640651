"""Pattern rules on text: a length limit, deny-list expressions and PII patterns, each to block or redact.

Pure and synchronous: the gateway runs them inline on prompts and on generated text. A
rule's `name` is what refusals and goodput_guard_blocks_total report; neither the text
nor the match leaves this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from goodput_contract.api.pipeline_spec import BLOCK, Pattern, Rules

MAX_LENGTH_RULE = "max-length"


def luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _is_card(match: re.Match[str]) -> bool:
    digits = re.sub(r"\D", "", match.group())
    return 13 <= len(digits) <= 19 and luhn(digits)


def _is_phone(match: re.Match[str]) -> bool:
    return 10 <= sum(ch.isdigit() for ch in match.group()) <= 15


# type -> (expression, a check a match must also pass)
PII: dict[str, tuple[re.Pattern[str], Callable[[re.Match[str]], bool]]] = {
    "email": (re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), lambda m: True),
    # not the tail of a longer digit run ("4111 1111 1111 1112" holds no phone number)
    "phone": (re.compile(r"(?<![\w+])(?<!\d[ .-])\(?\+?\d(?:[ .-]?\(?\d\)?){9,14}(?![\w-])(?![ .]\d)"), _is_phone),
    "card": (re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)"), _is_card),
}


@dataclass(frozen=True)
class Match:
    rule: str
    start: int
    end: int
    block: bool
    replacement: str


@dataclass(frozen=True)
class Compiled:
    rule: Pattern
    expression: re.Pattern[str]
    accept: Callable[[re.Match[str]], bool]

    def finditer(self, text: str) -> list[Match]:
        block = self.rule.action == BLOCK
        return [
            Match(self.rule.name, m.start(), m.end(), block, self.rule.replacement)
            for m in self.expression.finditer(text)
            if m.end() > m.start() and self.accept(m)
        ]


@dataclass(frozen=True)
class Verdict:
    text: str  # the text with redactions applied
    blocked_by: str | None = None  # the first blocking rule that matched
    redacted: tuple[str, ...] = ()  # rules that redacted something


class RuleSet:
    def __init__(self, rules: Rules) -> None:
        self.max_length = rules.max_length
        self.patterns = tuple(
            [Compiled(p, re.compile(p.pattern), lambda m: True) for p in rules.deny]
            + [Compiled(p, PII[p.pattern][0], PII[p.pattern][1]) for p in rules.pii]
        )

    def matches(self, text: str) -> list[Match]:
        """Every rule's matches, by start; where two overlap the earlier (then longer) one wins."""
        found = sorted((m for c in self.patterns for m in c.finditer(text)), key=lambda m: (m.start, -m.end))
        kept: list[Match] = []
        for m in found:
            if kept and m.start < kept[-1].end:
                if m.block and not kept[-1].block:
                    kept[-1] = m
                continue
            kept.append(m)
        return kept

    def check(self, text: str, length: bool = True) -> Verdict:
        """The whole text at once (a prompt, a finished answer); `length`: the length limit applies too."""
        if length and self.max_length is not None and len(text) > self.max_length:
            return Verdict(text, MAX_LENGTH_RULE)
        found = self.matches(text)
        blocking = next((m for m in found if m.block), None)
        if blocking:
            return Verdict(text, blocking.rule)
        return Verdict(redact(text, found), None, tuple(dict.fromkeys(m.rule for m in found)))


def redact(text: str, found: list[Match]) -> str:
    if not found:
        return text
    parts, at = [], 0
    for m in found:
        parts.append(text[at : m.start])
        parts.append(m.replacement)
        at = m.end
    parts.append(text[at:])
    return "".join(parts)
