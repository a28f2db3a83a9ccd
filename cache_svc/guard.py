"""The second check of a semantic hit: embeddings alone confuse questions that only look
alike ("3 eggs" / "4 eggs", France / Germany, "USD to EUR" / "EUR to USD", "is" / "is
not", pros / cons). Two questions may share an answer only if they agree on:

- numbers (digits, number words, ordinals, Roman numerals after a name: "3" = "three",
  "2nd" = "second", "World War II" = "Second World War"), in the same order;
- negation (not, never, n't, without... present in both or neither);
- named things (capitalised words, acronyms, C++ / C# / .NET) and units (grams, miles,
  Celsius..., canonicalised: "lbs" = "pounds"): one question may name more than the other
  ("the highest mountain on Earth"), but none may swap one for another (France / Germany);
- direction: what stands on either side of "to", "into", "than", "divided by", "minus"
  (binary to decimal / decimal to binary, 10 divided by 2 / 2 divided by 10);
- opposites: words from the two sides of one pair of opposites (pros / cons, before /
  after, toxic / safe...), synonyms sharing a side.

Pure string work on the two questions, about 0.2 ms a pair (bench/semantic_cache.py).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from cache_svc.guard_words import (
    ALIASES,
    DECADES,
    DIRECTIONS,
    FILLER,
    GENERIC,
    LOWER_NAMES,
    NEGATIONS,
    OPENERS,
    ORDINALS,
    ROMAN,
    SCALES,
    SIDES,
    SMALL,
    STOP,
    SYNONYM,
    UNIT_KINDS,
    UNITS,
    WORD,
)


@dataclass(frozen=True)
class Facts:
    numbers: tuple[float, ...]  # in order
    negated: bool
    named: tuple[str, ...]  # named things, lowercased
    units: tuple[str, ...]  # canonical
    names: tuple[str, ...]  # the proper names among them (no acronyms), in order
    content: tuple[str, ...]  # the words that carry meaning, stemmed, in order
    directions: frozenset[tuple[str, str]]  # (left, right) around a direction word
    sides: frozenset[tuple[int, int]]  # (pair of opposites, side)


def facts(text: str) -> Facts:
    words = WORD.findall(text.replace("\u2019", "'"))
    lows = [w.lower().removesuffix("'s") for w in words]
    items = _items(words, lows)
    numbers = tuple(float(v) for kind, v in items if kind == "num")
    named = tuple(v for kind, v in items if kind in ("named", "name"))
    units = tuple(v for kind, v in items if kind == "unit")
    names = tuple(v for kind, v in items if kind == "name")
    negated = any(w in NEGATIONS or w.endswith("n't") for w in lows)
    sides = set()
    for i, w in enumerate(lows):
        for key in (w, f"{w} {lows[i + 1]}" if i + 1 < len(lows) else ""):
            sides.update(SIDES.get(key, ()))
    content = tuple(_stem(v) for kind, v in items if kind != "word" or v not in STOP)
    directions = _directions(items)
    return Facts(numbers, negated, named, units, names, content, directions, frozenset(sides))


def conflict(a: Facts, b: Facts) -> str | None:
    """Why the two questions may need different answers, or None."""
    if a.numbers != b.numbers:
        return "number" if sorted(a.numbers) != sorted(b.numbers) else "order"
    if a.negated != b.negated:
        return "negation"
    if _swapped(a.named, b.named):
        return "entity"
    if _swapped(a.units, b.units):
        return "unit"
    if any((y, x) in b.directions for x, y in a.directions if x != y):
        return "order"
    if _transposed(a.content, b.content):
        return "order"  # the same words, two of them swapped: dogs catch a cold from humans
    for g in {g for g, _ in a.sides - b.sides} & {g for g, _ in b.sides - a.sides}:
        mine = {s for gg, s in a.sides if gg == g}
        theirs = {s for gg, s in b.sides if gg == g}
        if mine - theirs and theirs - mine:
            return "opposite"
    if _one_swapped(a.content, b.content):
        return "substitution"  # one word for another: boiling / freezing point
    return None


def _items(words: list[str], lows: list[str]) -> list[tuple[str, str]]:
    """The question as ("num" | "name" | "named" | "unit" | "word", value) items, in
    order ("named": acronyms, aliases and lowercase names)."""
    items, i = [], 0
    while i < len(words):
        value, used = _number(words, i)
        if used:
            items.append(("num", f"{value:g}"))
        elif lows[i] in UNITS:
            kind = lows[i - 1] if i and lows[i - 1] in UNIT_KINDS else ""
            items.append(("unit", f"{kind} {UNITS[lows[i]]}".strip()))
            used = 1
        elif lows[i] in LOWER_NAMES:
            items.append(("named", lows[i]))
            used = 1
        elif used := _alias(lows, i):
            items.append(("named", ALIASES[" ".join(lows[i : i + used])]))
        elif _is_named(words[i]):
            used = _name_length(words, i)
            name = [w for w in lows[i : i + used] if w not in GENERIC] or lows[i : i + used]
            kind = "named" if words[i].isupper() else "name"  # an acronym, or a proper name
            items.append((kind, ALIASES.get(" ".join(name), " ".join(name))))
        else:
            items.append(("word", lows[i]))
            used = 1
        i += used
    return items


def _name_length(words: list[str], i: int) -> int:
    """Words of one name starting at ``i``: New Mexico, West Virginia (an acronym stands
    alone: "SQL JOIN" names two things)."""
    if words[i].isupper():
        return 1
    n = 1
    while i + n < len(words) and _is_named(words[i + n]) and not words[i + n].isupper():
        n += 1
    return n


def _alias(lows: list[str], i: int) -> int:
    """How many words at ``i`` form a known alias (longest first); 0: none."""
    for n in (4, 3, 2, 1):
        if i + n <= len(lows) and " ".join(lows[i : i + n]) in ALIASES:
            return n
    return 0


def _transposed(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """``b`` is ``a`` with two words trading places (a question reworded moves words
    around more than that: "A hexagon has how many sides?")."""
    if len(a) != len(b):
        return False
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return len(diff) == 2 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def _one_swapped(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Everything alike but one word on each side, not the same in other words (no
    rewording: a different question: boiling / freezing point)."""
    only_a, only_b = Counter(a) - Counter(b), Counter(b) - Counter(a)
    if sum(only_a.values()) != 1 or sum(only_b.values()) != 1:
        return False
    (x,), (y,) = only_a, only_b
    return not _same_word(x, y)


def _same_word(x: str, y: str) -> bool:
    short, long = sorted((x, y), key=len)
    if len(short) >= 4 and (long.startswith(short) or short[:5] == long[:5]):
        return True  # one stem: health / healthier, pack / packing
    return x in SYNONYM and SYNONYM[x] == SYNONYM.get(y)


def _stem(word: str) -> str:
    """Plural and possessive off: "minutes" = "minute", "flies" = "fly"."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _swapped(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Each names something the other does not: a swap, not an addition."""
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    return bool(only_a and only_b)


def _directions(items: list[tuple[str, str]]) -> frozenset[tuple[str, str]]:
    """(left, right) around each direction word (the next content word on each side, and the
    nearest named thing, unit or number within four words), and what follows
    "from" with what follows the next "to"."""
    seq = [(k, v) for k, v in items if k != "word" or v not in FILLER or v in DIRECTIONS]
    pairs = set()
    for pos, (kind, word) in enumerate(seq):
        if kind != "word":
            continue
        if word in DIRECTIONS:
            for keyed in (False, True):
                left, right = _near(seq, pos, -1, keyed), _near(seq, pos, 1, keyed)
                if left and right:
                    pairs.add((left, right))
        if word == "from" and pos + 1 < len(seq):
            to = next((p for p in range(pos + 1, len(seq)) if seq[p] == ("word", "to")), None)
            if to is not None and (right := _near(seq, to, 1, False)):
                pairs.add((seq[pos + 1][1], right))
    return frozenset(pairs)


def _near(seq: list[tuple[str, str]], pos: int, step: int, keyed: bool) -> str | None:
    """The next item from ``pos`` in ``step``'s direction; ``keyed``: the nearest named
    thing, unit or number within four items."""
    if keyed:
        for p in range(pos + step, pos + 5 * step, step):
            if 0 <= p < len(seq) and seq[p][0] != "word":
                return seq[p][1]
        return None
    p = pos + step
    if 0 <= p < len(seq) and seq[p][1] not in DIRECTIONS:
        return seq[p][1]
    return None


def _is_named(word: str) -> bool:
    if word in ("I", "I'm") or not word[:1].isalpha() or word in ROMAN:
        return False
    if word.isupper() and len(word) > 1:
        return True  # an acronym: USD, NASA, SQL
    if word.endswith(("++", "#")) or word == ".NET":
        return True
    return word[0].isupper() and word.lower().removesuffix("'s") not in OPENERS


def _number(words: list[str], i: int) -> tuple[float, int]:
    """(value, words used) of a number starting at ``words[i]``; used = 0 when none."""
    w = words[i].lower()
    digits = re.fullmatch(r"(\d+(?:[.,:]\d+)*)(?:st|nd|rd|th)?", w)
    if digits:
        text = digits.group(1)
        if re.fullmatch(r"\d{1,3}(,\d{3})+", text):
            text = text.replace(",", "")
        try:
            return float(text.replace(",", ".")), 1
        except ValueError:  # a time (3:30) or a version (1.2.3): compare the text
            return float(int.from_bytes(text.encode()[:7], "big")), 1
    if w in DECADES:
        return float(DECADES[w]), 1
    if re.fullmatch(r"'?\d+0s", w):  # the 1960s, the '60s
        year = int(w.strip("'s"))
        return float(year if year >= 100 else 1900 + year), 1
    if words[i] == "First":  # First World War, First Amendment ("first": an opposite)
        return 1.0, 1
    if w in ORDINALS:
        return float(ORDINALS[w]), 1
    after_name = i > 0 and words[i - 1][:1].isupper()
    if after_name and (words[i] in ROMAN or (words[i] == "I" and words[i - 1] == "War")):
        return float(ROMAN.get(words[i], 1)), 1  # World War II, Henry VIII
    return _number_words(words, i)


def _number_words(words: list[str], i: int) -> tuple[float, int]:
    total, current, used = 0, 0, 0
    while i + used < len(words):
        t = words[i + used].lower()
        if t in SMALL:
            value = SMALL[t]
            if current % 100 and not (value < 10 and current % 10 == 0 and current % 100 >= 20):
                break  # "fifty thirty": two numbers; "forty four": one
            current += value
        elif t in SCALES and (used or t != "hundred"):
            current = max(current, 1) * SCALES[t]
            if SCALES[t] > 100:
                total, current = total + current, 0
        elif not (t == "and" and used):
            break
        used += 1
    while used and words[i + used - 1].lower() == "and":
        used -= 1
    if used == 1 and words[i].lower() == "one":  # "which one", "one of": no quantity
        return 0.0, 0
    return float(total + current), used
