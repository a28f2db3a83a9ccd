"""The second check of a semantic hit: each kind of disagreement it must see, and the
rewordings it must let through."""

from __future__ import annotations

import pytest

from cache_svc.guard import conflict, facts

MUST_DIFFER = [
    ("number", "How many calories are in 3 eggs?", "How many calories are in 4 eggs?"),
    ("number", "What's new in Python 3.11?", "What's new in Python 3.12?"),
    ("number", "Who won the Super Bowl in 2015?", "Who won the Super Bowl in 2018?"),
    ("negation", "Is raw chicken safe to eat?", "Is raw chicken not safe to eat?"),
    (
        "negation",
        "What should I do before an interview?",
        "What shouldn't I do before an interview?",
    ),
    ("entity", "What is the capital of France?", "What is the capital of Germany?"),
    ("entity", "What is the population of New Mexico?", "What is the population of Mexico?"),
    ("entity", "What is the atomic mass of carbon?", "What is the atomic mass of nitrogen?"),
    ("order", "How do I convert USD to EUR?", "How do I convert EUR to USD?"),
    ("order", "How do I convert binary to decimal?", "How do I convert decimal to binary?"),
    (
        "order",
        "Is a crocodile bigger than an alligator?",
        "Is an alligator bigger than a crocodile?",
    ),
    ("order", "What is 10 divided by 2?", "What is 2 divided by 10?"),
    ("order", "Can dogs catch a cold from humans?", "Can humans catch a cold from dogs?"),
    ("unit", "How many grams are in a pound?", "How many grams are in a kilogram?"),
    ("unit", "How many meters are in a mile?", "How many meters are in a nautical mile?"),
    ("opposite", "What are the pros of electric cars?", "What are the cons of electric cars?"),
    ("opposite", "Which plants are toxic to cats?", "Which plants are safe for cats?"),
    (
        "substitution",
        "What is the boiling point of ethanol?",
        "What is the freezing point of ethanol?",
    ),
    ("substitution", "When was Microsoft founded?", "Where was Microsoft founded?"),
]

MAY_MATCH = [
    ("How do I boil an egg?", "What's the way to boil an egg?"),
    ("How many ounces are in 2 pounds?", "Two pounds is how many ounces?"),
    ("What were the causes of World War II?", "What caused the Second World War?"),
    ("How many states are in the United States?", "How many states does the USA have?"),
    (
        "How do I get from Heathrow to central London?",
        "Best way from Heathrow Airport to central London?",
    ),
    ("What is the tallest mountain in the world?", "Which mountain is the highest on Earth?"),
    ("What was pop music like in the 1960s?", "What was pop music like in the sixties?"),
    ("What is the 50/30/20 budget rule?", "Explain the fifty thirty twenty budget rule"),
    ("How do I delete a branch in git?", "How can I remove a git branch?"),
    ("A hexagon has how many sides?", "How many sides does a hexagon have?"),
]


@pytest.mark.parametrize("kind,a,b", MUST_DIFFER)
def test_disagreements_are_seen(kind, a, b):
    assert conflict(facts(a), facts(b)) == kind
    assert conflict(facts(b), facts(a)) is not None


@pytest.mark.parametrize("a,b", MAY_MATCH)
def test_rewordings_pass(a, b):
    assert conflict(facts(a), facts(b)) is None


def test_facts_read_numbers_names_and_units():
    f = facts("Is 1,000 more than one hundred and forty-four? Ask NASA in Los Angeles, in lbs.")
    assert f.numbers == (1000.0, 144.0)
    assert "nasa" in f.named and "los angeles" in f.named and f.units == ("pound",)
    assert facts("Which one is better?").numbers == ()  # "one" alone is no quantity
