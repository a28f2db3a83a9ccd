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


def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


_WORD = re.compile(
    r"\.NET\b|[A-Za-z]+(?:\+\+|#)|'?\d+0s\b|\d+(?:[.,:]\d+)*(?:st|nd|rd|th)?|[A-Za-z]+(?:'[a-z]+)?"
)

_UNITS = {
    "g": "gram", "gram": "gram", "grams": "gram", "kg": "kilogram", "kilo": "kilogram",
    "kilos": "kilogram", "kilogram": "kilogram", "kilograms": "kilogram", "mg": "milligram",
    "milligram": "milligram", "milligrams": "milligram", "lb": "pound", "lbs": "pound",
    "pound": "pound", "pounds": "pound", "oz": "ounce", "ounce": "ounce", "ounces": "ounce",
    "ton": "ton", "tons": "ton", "tonne": "tonne", "tonnes": "tonne", "stone": "stone",
    "mile": "mile", "miles": "mile", "mi": "mile", "mph": "mph", "km": "kilometer",
    "kilometer": "kilometer", "kilometers": "kilometer", "kilometre": "kilometer",
    "kilometres": "kilometer", "kph": "kph", "m": "meter", "meter": "meter", "meters": "meter",
    "metre": "meter", "metres": "meter", "cm": "centimeter", "centimeter": "centimeter",
    "centimeters": "centimeter", "mm": "millimeter", "millimeter": "millimeter",
    "millimeters": "millimeter", "inch": "inch", "inches": "inch", "foot": "foot", "feet": "foot",
    "ft": "foot", "yard": "yard", "yards": "yard", "cup": "cup", "cups": "cup",
    "tablespoon": "tablespoon", "tablespoons": "tablespoon", "tbsp": "tablespoon",
    "teaspoon": "teaspoon", "teaspoons": "teaspoon", "tsp": "teaspoon", "liter": "liter",
    "liters": "liter", "litre": "liter", "litres": "liter", "l": "liter", "ml": "milliliter",
    "milliliter": "milliliter", "milliliters": "milliliter", "millilitre": "milliliter",
    "gallon": "gallon", "gallons": "gallon", "quart": "quart", "quarts": "quart",
    "pint": "pint", "pints": "pint", "celsius": "celsius", "centigrade": "celsius",
    "fahrenheit": "fahrenheit", "kelvin": "kelvin", "minute": "minute", "minutes": "minute",
    "hour": "hour", "hours": "hour", "day": "day", "days": "day", "week": "week", "weeks": "week",
    "month": "month", "months": "month", "year": "year", "years": "year", "byte": "byte",
    "bytes": "byte", "kb": "kilobyte", "kilobyte": "kilobyte", "kilobytes": "kilobyte",
    "mb": "megabyte", "megabyte": "megabyte", "megabytes": "megabyte", "gb": "gigabyte",
    "gigabyte": "gigabyte", "gigabytes": "gigabyte", "tb": "terabyte", "terabyte": "terabyte",
    "terabytes": "terabyte", "watt": "watt", "watts": "watt", "kw": "kilowatt",
    "kilowatt": "kilowatt", "kilowatts": "kilowatt", "volt": "volt", "volts": "volt",
    "acre": "acre", "acres": "acre", "hectare": "hectare", "hectares": "hectare",
    "calorie": "calorie", "calories": "calorie", "kcal": "calorie", "joule": "joule",
    "joules": "joule", "dollar": "dollar", "dollars": "dollar", "euro": "euro", "euros": "euro",
    "seconds": "second", "sec": "second", "secs": "second", "knot": "knot", "knots": "knot",
    "bit": "bit", "bits": "bit", "psi": "psi", "pascal": "pascal", "pascals": "pascal",
    "pa": "pascal", "kpa": "kilopascal", "hpa": "hectopascal", "hectopascal": "hectopascal",
    "hectopascals": "hectopascal", "millibar": "millibar", "millibars": "millibar",
    "mbar": "millibar", "atm": "atmosphere", "atmospheres": "atmosphere", "degree": "degree",
    "degrees": "degree", "radian": "radian", "radians": "radian", "nanometer": "nanometer",
    "nanometers": "nanometer", "nm": "nanometer", "micron": "micron", "microns": "micron",
    "amp": "ampere", "amps": "ampere", "ampere": "ampere", "amperes": "ampere", "ohm": "ohm",
    "ohms": "ohm", "hz": "hertz", "hertz": "hertz", "khz": "kilohertz", "mhz": "megahertz",
    "ghz": "gigahertz", "btu": "btu", "btus": "btu", "kwh": "kilowatt hour", "wh": "watt hour",
    "decibel": "decibel", "decibels": "decibel", "db": "decibel", "lux": "lux", "lumen": "lumen",
    "lumens": "lumen", "carat": "carat", "carats": "carat", "grain": "grain", "grains": "grain",
    "fathom": "fathom", "fathoms": "fathom", "furlong": "furlong", "furlongs": "furlong",
    "league": "league", "leagues": "league", "quarter": "quarter", "quarters": "quarter",
}  # fmt: skip

_NEGATIONS = {"not", "no", "never", "without", "none", "neither", "nor", "nobody", "nothing",
              "cannot", "nowhere"}  # fmt: skip

# Each entry: one pair of opposites, each side a few words that mean the same. A word may
# stand in several pairs (toxic is the opposite of safe and of edible).
_OPPOSITES = [
    ("pros advantages advantage benefits benefit upsides upside good",
     "cons disadvantages disadvantage drawbacks drawback downsides downside risks risk dangers bad"),
    ("increase increases raise raising higher more gain boost", "decrease decreases lower lowering reduce less lose"),
    ("before earlier prior", "after later"), ("today", "tomorrow yesterday"),
    ("start begin beginning starting opening opens open", "end stop ending finish closing closes close"),
    ("enable turn_on activate", "disable turn_off deactivate"), ("add insert", "remove delete"),
    ("buy purchase buying", "sell selling"), ("import", "export"), ("upload", "download"),
    ("encrypt", "decrypt"), ("encode", "decode"), ("compress zip", "decompress unzip extract"),
    ("push", "pull"), ("lock", "unlock"), ("install", "uninstall"), ("show unhide reveal", "hide"),
    ("join", "leave"), ("win won", "lose lost"), ("hot hottest warm warmest", "cold coldest cool"),
    ("safe edible harmless", "unsafe dangerous toxic poisonous harmful"), ("legal", "illegal"),
    ("healthy", "unhealthy"), ("possible", "impossible"),
    ("minimum min smallest lowest least", "maximum max largest highest most biggest"),
    ("sum addition total", "product multiply multiplication"), ("subtract minus", "divide"),
    ("area", "perimeter circumference volume"), ("singular", "plural"),
    ("present", "past future"), ("north northern", "south southern"), ("east eastern", "west western"),
    ("input", "output"), ("inside indoor indoors", "outside outdoor outdoors"),
    ("long longer longest", "short shorter shortest"), ("fast faster fastest quick", "slow slower slowest"),
    ("big bigger large larger", "small smaller tiny"), ("heavy heavier", "light lighter"),
    ("cheap cheaper cheapest", "expensive pricier"), ("better best", "worse worst"),
    ("true", "false"), ("positive", "negative"), ("odd", "even"), ("wet", "dry"),
    ("male men man boys", "female women woman girls"),
    ("old older oldest", "young younger youngest new newer newest"),
    ("arrive arrival", "depart departure leave"), ("send sending", "receive receiving"),
    ("borrow", "lend"), ("rise sunrise", "set sunset"), ("morning", "evening night"),
    ("summer", "winter"), ("spring", "autumn fall"), ("weekday weekdays", "weekend weekends"),
    ("cause causes", "cure cures treat treatment prevent"), ("eat", "avoid"),
    ("allowed permitted", "forbidden banned prohibited"), ("accept", "reject"),
    ("left", "right"), ("top", "bottom"), ("upstairs uphill upward", "downstairs downhill downward"),
    ("log_in login sign_in signin", "log_out logout sign_out signout"), ("last final", "first"),
]  # fmt: skip

_SIDES: dict[str, list[tuple[int, int]]] = {}
for _group, _pair in enumerate(_OPPOSITES):
    for _side, _words in enumerate(_pair):
        for _w in _words.split():
            _SIDES.setdefault(_w.replace("_", " "), []).append((_group, _side))

_SMALL = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
          "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
          "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
          "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
          "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12}  # fmt: skip
_ORDINALS = {"second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6,
             "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10, "twelfth": 12,
             "twentieth": 20, "hundredth": 100}  # fmt: skip
_ROMAN = {"II": 2, "III": 3, "IV": 4, "V": 5, "VI": 6, "VII": 7, "VIII": 8, "IX": 9, "X": 10}
_DECADES = {"twenties": 1920, "thirties": 1930, "forties": 1940, "fifties": 1950,
            "sixties": 1960, "seventies": 1970, "eighties": 1980, "nineties": 1990}  # fmt: skip
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
# Several names of one thing (compared as one).
_ALIASES = {
    "usa": "usa", "us": "usa", "u.s.": "usa", "america": "usa", "american": "usa",
    "americans": "usa", "united states": "usa", "united states of america": "usa",
    "uk": "uk", "britain": "uk", "british": "uk", "united kingdom": "uk", "great britain": "uk",
    "eu": "eu", "european union": "eu", "un": "un", "united nations": "un",
    "japan": "japan", "japanese": "japan", "china": "china", "chinese": "china",
    "france": "france", "french": "france", "germany": "germany", "german": "germany",
    "italy": "italy", "italian": "italy", "spain": "spain", "spanish": "spain",
    "india": "india", "indian": "india", "canada": "canada", "canadian": "canada",
    "mexico": "mexico", "mexican": "mexico", "russia": "russia", "russian": "russia",
    "australia": "australia", "australian": "australia", "brazil": "brazil",
    "brazilian": "brazil", "korea": "korea", "korean": "korea", "nyc": "new york",
    "new york city": "new york", "dict": "dictionary", "js": "javascript",
}  # fmt: skip
# Words that make a unit another unit (a nautical mile is no mile).
_UNIT_KINDS = {"nautical", "square", "cubic", "fluid", "imperial", "metric", "troy", "light",
               "statute", "short", "long", "us"}  # fmt: skip
# Names written in lowercase: the chemical elements.
_LOWER_NAMES = _wordset("""hydrogen helium lithium beryllium boron carbon nitrogen oxygen fluorine neon
sodium magnesium aluminum aluminium silicon phosphorus sulfur sulphur chlorine argon potassium
calcium titanium chromium manganese iron cobalt nickel copper zinc gallium germanium arsenic
selenium bromine krypton rubidium strontium zirconium silver tin iodine xenon cesium barium
tungsten platinum gold mercury lead radon radium uranium plutonium""")  # fmt: skip
# Words that only say what kind of thing a name is (Heathrow Airport = Heathrow).
_GENERIC = {"airport", "city", "station", "university", "river", "lake", "mountain", "mount",
            "street", "avenue", "park", "inc", "corp", "company", "island", "islands"}  # fmt: skip
# What the two sides of a direction stand around.
_DIRECTIONS = {"to", "into", "than", "minus", "by", "over", "versus", "vs"}
_FILLER = _wordset("""a an the my your our their his her its this that these those some of for in on
at per and or is are be it""")  # fmt: skip

# Words too common to say what a question is about (wh-words stay: when / where differ).
_STOP = _FILLER | _wordset("""do does did can could should would will shall may might must i
you me we us get got have has had to from with about as into onto be been being am was were
there here so then just please also very really what which explain define describe
tell list name give show mean means meaning exactly""")  # fmt: skip
# Words that mean the same in a question (one group a line).
_SYNONYM_GROUPS = [
    "why reason cause caused causes make makes made", "how way ways steps method can",
    "world earth planet globe", "delete remove erase", "main central primary key chief",
    "wrote write written author authored", "use using used work works working",
    "vs versus difference differ compare", "big large huge", "small little tiny",
    "fast quick quickly rapid", "car auto automobile vehicle", "pc computer laptop",
    "kid child children", "mom mother", "dad father", "buy purchase", "fix repair",
    "begin start", "end finish", "need require required", "good fine okay ok",
    "help assist", "build construct constructed built", "invent invented create created",
    "job work career", "doctor physician", "film movie", "show display", "get obtain",
    "find locate", "make cook prepare brew", "home homemade house",
]  # fmt: skip
_SYNONYM = {w: g for g, line in enumerate(_SYNONYM_GROUPS) for w in line.split()}
# Capitalised words that name nothing (a question's opener, a sentence's first word).
_OPENERS = _wordset("""how what whats what's which who whom whose why where when is are was were do does
did can could should would will shall may might must any tell give explain describe list name
show find convert compare i im i'm my it in on at for from to the a an if please help quick hey hi
best easiest recommend tips ways way""")  # fmt: skip


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
    words = _WORD.findall(text.replace("\u2019", "'"))
    lows = [w.lower().removesuffix("'s") for w in words]
    items = _items(words, lows)
    numbers = tuple(float(v) for kind, v in items if kind == "num")
    named = tuple(v for kind, v in items if kind in ("named", "name"))
    units = tuple(v for kind, v in items if kind == "unit")
    names = tuple(v for kind, v in items if kind == "name")
    negated = any(w in _NEGATIONS or w.endswith("n't") for w in lows)
    sides = set()
    for i, w in enumerate(lows):
        for key in (w, f"{w} {lows[i + 1]}" if i + 1 < len(lows) else ""):
            sides.update(_SIDES.get(key, ()))
    content = tuple(_stem(v) for kind, v in items if kind != "word" or v not in _STOP)
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
        elif lows[i] in _UNITS:
            kind = lows[i - 1] if i and lows[i - 1] in _UNIT_KINDS else ""
            items.append(("unit", f"{kind} {_UNITS[lows[i]]}".strip()))
            used = 1
        elif lows[i] in _LOWER_NAMES:
            items.append(("named", lows[i]))
            used = 1
        elif used := _alias(lows, i):
            items.append(("named", _ALIASES[" ".join(lows[i : i + used])]))
        elif _is_named(words[i]):
            used = _name_length(words, i)
            name = [w for w in lows[i : i + used] if w not in _GENERIC] or lows[i : i + used]
            kind = "named" if words[i].isupper() else "name"  # an acronym, or a proper name
            items.append((kind, _ALIASES.get(" ".join(name), " ".join(name))))
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
        if i + n <= len(lows) and " ".join(lows[i : i + n]) in _ALIASES:
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
    return x in _SYNONYM and _SYNONYM[x] == _SYNONYM.get(y)


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
    seq = [(k, v) for k, v in items if k != "word" or v not in _FILLER or v in _DIRECTIONS]
    pairs = set()
    for pos, (kind, word) in enumerate(seq):
        if kind != "word":
            continue
        if word in _DIRECTIONS:
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
    if 0 <= p < len(seq) and seq[p][1] not in _DIRECTIONS:
        return seq[p][1]
    return None


def _is_named(word: str) -> bool:
    if word in ("I", "I'm") or not word[:1].isalpha() or word in _ROMAN:
        return False
    if word.isupper() and len(word) > 1:
        return True  # an acronym: USD, NASA, SQL
    if word.endswith(("++", "#")) or word == ".NET":
        return True
    return word[0].isupper() and word.lower().removesuffix("'s") not in _OPENERS


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
    if w in _DECADES:
        return float(_DECADES[w]), 1
    if re.fullmatch(r"'?\d+0s", w):  # the 1960s, the '60s
        year = int(w.strip("'s"))
        return float(year if year >= 100 else 1900 + year), 1
    if words[i] == "First":  # First World War, First Amendment ("first": an opposite)
        return 1.0, 1
    if w in _ORDINALS:
        return float(_ORDINALS[w]), 1
    after_name = i > 0 and words[i - 1][:1].isupper()
    if after_name and (words[i] in _ROMAN or (words[i] == "I" and words[i - 1] == "War")):
        return float(_ROMAN.get(words[i], 1)), 1  # World War II, Henry VIII
    return _number_words(words, i)


def _number_words(words: list[str], i: int) -> tuple[float, int]:
    total, current, used = 0, 0, 0
    while i + used < len(words):
        t = words[i + used].lower()
        if t in _SMALL:
            value = _SMALL[t]
            if current % 100 and not (value < 10 and current % 10 == 0 and current % 100 >= 20):
                break  # "fifty thirty": two numbers; "forty four": one
            current += value
        elif t in _SCALES and (used or t != "hundred"):
            current = max(current, 1) * _SCALES[t]
            if _SCALES[t] > 100:
                total, current = total + current, 0
        elif not (t == "and" and used):
            break
        used += 1
    while used and words[i + used - 1].lower() == "and":
        used -= 1
    if used == 1 and words[i].lower() == "one":  # "which one", "one of": no quantity
        return 0.0, 0
    return float(total + current), used
