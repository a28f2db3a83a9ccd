"""The word lists of the second check (``cache_svc/guard.py``): units and their
canonical names, negations, pairs of opposites, number words, aliases, words that name
nothing, synonyms. Data only; what they mean is said where they are used."""

from __future__ import annotations

import re


def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


WORD = re.compile(
    r"\.NET\b|[A-Za-z]+(?:\+\+|#)|'?\d+0s\b|\d+(?:[.,:]\d+)*(?:st|nd|rd|th)?|[A-Za-z]+(?:'[a-z]+)?"
)

UNITS = {
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

NEGATIONS = {"not", "no", "never", "without", "none", "neither", "nor", "nobody", "nothing",
             "cannot", "nowhere"}  # fmt: skip

# Each entry: one pair of opposites, each side a few words that mean the same. A word may
# stand in several pairs (toxic is the opposite of safe and of edible).
OPPOSITES = [
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

SIDES: dict[str, list[tuple[int, int]]] = {}
for _group, _pair in enumerate(OPPOSITES):
    for _side, _words in enumerate(_pair):
        for _w in _words.split():
            SIDES.setdefault(_w.replace("_", " "), []).append((_group, _side))

SMALL = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
         "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
         "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
         "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
         "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12}  # fmt: skip
ORDINALS = {"second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6,
            "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10, "twelfth": 12,
            "twentieth": 20, "hundredth": 100}  # fmt: skip
ROMAN = {"II": 2, "III": 3, "IV": 4, "V": 5, "VI": 6, "VII": 7, "VIII": 8, "IX": 9, "X": 10}
DECADES = {"twenties": 1920, "thirties": 1930, "forties": 1940, "fifties": 1950,
           "sixties": 1960, "seventies": 1970, "eighties": 1980, "nineties": 1990}  # fmt: skip
SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
# Several names of one thing (compared as one).
ALIASES = {
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
UNIT_KINDS = {"nautical", "square", "cubic", "fluid", "imperial", "metric", "troy", "light",
              "statute", "short", "long", "us"}  # fmt: skip
# Names written in lowercase: the chemical elements.
LOWER_NAMES = _wordset("""hydrogen helium lithium beryllium boron carbon nitrogen oxygen fluorine neon
sodium magnesium aluminum aluminium silicon phosphorus sulfur sulphur chlorine argon potassium
calcium titanium chromium manganese iron cobalt nickel copper zinc gallium germanium arsenic
selenium bromine krypton rubidium strontium zirconium silver tin iodine xenon cesium barium
tungsten platinum gold mercury lead radon radium uranium plutonium""")  # fmt: skip
# Words that only say what kind of thing a name is (Heathrow Airport = Heathrow).
GENERIC = {"airport", "city", "station", "university", "river", "lake", "mountain", "mount",
           "street", "avenue", "park", "inc", "corp", "company", "island", "islands"}  # fmt: skip
# What the two sides of a direction stand around.
DIRECTIONS = {"to", "into", "than", "minus", "by", "over", "versus", "vs"}
FILLER = _wordset("""a an the my your our their his her its this that these those some of for in on
at per and or is are be it""")  # fmt: skip

# Words too common to say what a question is about (wh-words stay: when / where differ).
STOP = FILLER | _wordset("""do does did can could should would will shall may might must i
you me we us get got have has had to from with about as into onto be been being am was were
there here so then just please also very really what which explain define describe
tell list name give show mean means meaning exactly""")  # fmt: skip
# Words that mean the same in a question (one group a line).
SYNONYM_GROUPS = [
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
SYNONYM = {w: g for g, line in enumerate(SYNONYM_GROUPS) for w in line.split()}
# Capitalised words that name nothing (a question's opener, a sentence's first word).
OPENERS = _wordset("""how what whats what's which who whom whose why where when is are was were do does
did can could should would will shall may might must any tell give explain describe list name
show find convert compare i im i'm my it in on at for from to the a an if please help quick hey hi
best easiest recommend tips ways way""")  # fmt: skip
