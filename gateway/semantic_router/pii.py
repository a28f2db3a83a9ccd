"""The PII guard's detectors: emails, phone numbers, card numbers, IBANs, extra patterns.

Each detector returns spans; a digit run is only a card number when its Luhn checksum
holds and only an IBAN when its mod-97 checksum does, so order numbers, tracking codes
and other long digit strings pass. Phone numbers are whatever ``phonenumbers`` accepts as
a valid number of one of the configured regions (or an international +NN one); that
package is the ``pii`` extra, imported only when the guard looks for phone numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.semantic_router.config import PiiGuard

_EMAIL = re.compile(r"\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b")
# 13-19 digits, optionally grouped by single spaces or dashes.
_CARD = re.compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d\-])")
# Country code, check digits, then 11-30 letters/digits, optionally in groups of four.
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
# Lengths of IBANs of the countries most often seen (ISO 13616 registry); others: 15-34.
_IBAN_LENGTHS = {
    "AT": 20,
    "BE": 16,
    "CH": 21,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "ES": 24,
    "FI": 18,
    "FR": 27,
    "GB": 22,
    "GR": 27,
    "HU": 28,
    "IE": 22,
    "IT": 27,
    "LU": 20,
    "NL": 18,
    "NO": 15,
    "PL": 28,
    "PT": 25,
    "RO": 24,
    "SE": 24,
    "SK": 24,
}


@dataclass(frozen=True)
class Finding:
    """One piece of personal data: its kind and where it is."""

    kind: str  # "email", "phone", "card", "iban" or an extra pattern's name
    start: int
    end: int


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum of a digit string (every second digit from the right doubled)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(iban: str) -> bool:
    """Whether ``iban`` (spaces allowed) has a valid length and ISO 7064 mod-97 checksum."""
    s = iban.replace(" ", "").upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]+", s):
        return False
    want = _IBAN_LENGTHS.get(s[:2])
    if (want is not None and len(s) != want) or not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]  # letters count as 10..35
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


class PiiDetector:
    """Finds the configured kinds of personal data in a text."""

    def __init__(self, config: PiiGuard):
        self.kinds = frozenset(config.kinds)
        self.regions = [r.upper() for r in config.phone_regions] or [None]
        self.extra = [(p.name, re.compile(p.regex)) for p in config.patterns]

    def find(self, text: str) -> list[Finding]:
        """Non-overlapping findings, in order of position (cards and IBANs claim their
        digits first, so a card number is not also a phone number)."""
        found: list[Finding] = []
        if "card" in self.kinds:
            found += [
                Finding("card", m.start(), m.end())
                for m in _CARD.finditer(text)
                if luhn_ok(re.sub(r"\D", "", m.group()))
            ]
        if "iban" in self.kinds:
            found += [
                Finding("iban", m.start(), m.end())
                for m in _IBAN.finditer(text)
                if iban_ok(m.group())
            ]
        if "email" in self.kinds:
            found += [Finding("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
        for name, rx in self.extra:
            found += [Finding(name, m.start(), m.end()) for m in rx.finditer(text) if m.group()]
        if "phone" in self.kinds and any(c.isdigit() for c in text):
            found += self._phones(text)
        return _without_overlaps(found)

    def _phones(self, text: str) -> list[Finding]:
        import phonenumbers  # the config checked that it is installed

        spans: dict[tuple[int, int], Finding] = {}
        for region in self.regions:
            for m in phonenumbers.PhoneNumberMatcher(text, region):
                spans.setdefault((m.start, m.end), Finding("phone", m.start, m.end))
        return list(spans.values())


def _without_overlaps(found: list[Finding]) -> list[Finding]:
    """The earliest-listed finding keeps contested characters (cards, IBANs, emails and
    named patterns come before phones)."""
    kept: list[Finding] = []
    for f in found:
        if all(f.end <= k.start or f.start >= k.end for k in kept):
            kept.append(f)
    return sorted(kept, key=lambda f: f.start)


def redact(text: str, findings: list[Finding]) -> str:
    """``text`` with each finding replaced by its kind in brackets: ``[EMAIL]``."""
    out, pos = [], 0
    for f in sorted(findings, key=lambda f: f.start):
        out += [text[pos : f.start], f"[{f.kind.upper()}]"]
        pos = f.end
    out.append(text[pos:])
    return "".join(out)
