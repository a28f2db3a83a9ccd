"""The PII guard: checksums decide what is a card number or an IBAN, phonenumbers what
is a phone number; redaction replaces exactly the found spans; the configured action is
what happens (allow / redact / block)."""

from __future__ import annotations

import pytest

from gateway.semantic_router.config import PatternRule, PiiGuard, parse_config
from gateway.semantic_router.guards import check_pii
from gateway.semantic_router.pii import PiiDetector, iban_ok, luhn_ok, redact
from gateway.semantic_router.state import compile_state


def kinds(text: str, **cfg) -> list[str]:
    return [f.kind for f in PiiDetector(PiiGuard(**cfg)).find(text)]


@pytest.mark.parametrize(
    "number",
    ["4111111111111111", "5555555555554444", "378282246310005", "6011111111111117", "79927398713"],
)
def test_luhn_accepts_valid_numbers(number):
    assert luhn_ok(number)


@pytest.mark.parametrize("number", ["4111111111111112", "1234567812345678", "79927398710"])
def test_luhn_refuses_one_digit_off(number):
    assert not luhn_ok(number)


@pytest.mark.parametrize(
    "iban",
    [
        "GB82 WEST 1234 5698 7654 32",
        "DE89370400440532013000",
        "FR1420041010050500013M02606",
        "NL91ABNA0417164300",
    ],
)
def test_iban_checksum_and_length(iban):
    assert iban_ok(iban)


@pytest.mark.parametrize(
    "iban",
    [
        "GB83 WEST 1234 5698 7654 32",  # check digits off by one
        "DE8937040044053201300",  # one character short for DE
        "GB12 ABCD 1234 5678 9012 34",
    ],
)
def test_iban_refused(iban):
    assert not iban_ok(iban)


def test_cards_only_with_a_valid_checksum():
    assert kinds("pay with 4111 1111 1111 1111 today") == ["card"]
    assert kinds("pay with 4111-1111-1111-1111 today") == ["card"]
    assert kinds("order number 4111 1111 1111 1112, where is it?") == []


@pytest.mark.parametrize(
    "text",
    [
        "call me on (415) 555-0132",
        "ring +44 20 7946 0958",
        "my mobile is 07911 123456",
        "text 415-555-0178 later",
    ],
)
def test_phone_numbers(text):
    assert kinds(text) == ["phone"]


@pytest.mark.parametrize(
    "text",
    [
        "the year 2024 had 8760 hours",
        "use version 3.12.1 on port 8080",
        "the meeting is on 2024-05-17 at 14:30 in room 204",
        "ISBN 978-3-16-148410-0",
    ],
)
def test_numbers_that_are_no_pii(text):
    assert kinds(text) == []


def test_emails_and_only_configured_kinds():
    text = "write to anna.k@mailbox.net or call +1 415 555 0132"
    assert kinds(text) == ["email", "phone"]
    assert kinds(text, kinds=["email"]) == ["email"]


def test_extra_patterns():
    rule = PatternRule(name="employee_id", regex=r"\bEMP-\d{6}\b")
    assert kinds("badge EMP-123456 lost", kinds=[], patterns=[rule]) == ["employee_id"]


def test_redaction_text_is_exact():
    text = "mail john.doe@example.com, card 4111 1111 1111 1111, IBAN DE89370400440532013000."
    found = PiiDetector(PiiGuard()).find(text)
    assert redact(text, found) == "mail [EMAIL], card [CARD], IBAN [IBAN]."


def config(action: str):
    return parse_config(f"""
routes: [{{name: general, model: m}}]
default_route: general
guards: {{pii: {{action: {action}}}, jailbreak: {{action: allow}}}}
""")


async def test_actions_redact_copies_and_block_names_kinds():
    messages = [
        {"role": "system", "content": "reach ops@corp.example"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "I am bob@example.org"},
                {"type": "image", "image": b"x"},
            ],
        },
    ]
    redacted = check_pii(await compile_state(config("redact"), None), messages, None)
    assert redacted.action == "redact" and redacted.kinds == ["email"]
    assert redacted.messages[1]["content"][0]["text"] == "I am [EMAIL]"
    assert redacted.messages[0]["content"] == "reach ops@corp.example"  # only user turns
    assert messages[1]["content"][0]["text"] == "I am bob@example.org"  # the original kept
    blocked = check_pii(await compile_state(config("block"), None), None, "call 415-555-0178")
    assert blocked.action == "block" and "phone" in blocked.reason and blocked.header == "block:pii"
    allowed = check_pii(await compile_state(config("allow"), None), None, "call 415-555-0178")
    assert allowed.action == "allow" and allowed.guard == "pii" and allowed.header == "allow"
    prompt = check_pii(await compile_state(config("redact"), None), None, "call 415-555-0178 now")
    assert prompt.prompt == "call [PHONE] now"
