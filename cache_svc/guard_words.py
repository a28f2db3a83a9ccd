"""The word lists of the second check (``cache_svc/guard.py``): units and their
canonical names, negations, pairs of opposites, number words, aliases, words that name
nothing, synonyms. Data only; what they mean is said where they are used."""

from __future__ import annotations

import re


def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _names(text: str) -> dict[str, str]:
    """``canonical: name name ...`` a line -> {name: canonical}; ``_`` stands for a space."""
    out = {}
    for line in text.strip().splitlines():
        canonical, _, names = line.partition(":")
        for name in names.split():
            out[name.replace("_", " ")] = canonical.strip().replace("_", " ")
    return out


def _numbers(text: str) -> dict[str, int]:
    """``word=value ...`` -> {word: value}."""
    return {w: int(v) for w, _, v in (item.partition("=") for item in text.split())}


def _pairs(text: str) -> list[tuple[str, str]]:
    """``one side | the other`` a line -> [(one side, the other)], in order."""
    return [tuple(side.strip() for side in line.split("|")) for line in text.strip().splitlines()]


WORD = re.compile(
    r"\.NET\b|[A-Za-z]+(?:\+\+|#)|'?\d+0s\b|\d+(?:[.,:]\d+)*(?:st|nd|rd|th)?|[A-Za-z]+(?:'[a-z]+)?"
)

UNITS = _names(
    """
gram: g gram grams
kilogram: kg kilo kilos kilogram kilograms
milligram: mg milligram milligrams
pound: lb lbs pound pounds
ounce: oz ounce ounces
ton: ton tons
tonne: tonne tonnes
stone: stone
mile: mile miles mi
mph: mph
kilometer: km kilometer kilometers kilometre kilometres
kph: kph
meter: m meter meters metre metres
centimeter: cm centimeter centimeters
millimeter: mm millimeter millimeters
inch: inch inches
foot: foot feet ft
yard: yard yards
cup: cup cups
tablespoon: tablespoon tablespoons tbsp
teaspoon: teaspoon teaspoons tsp
liter: liter liters litre litres l
milliliter: ml milliliter milliliters millilitre
gallon: gallon gallons
quart: quart quarts
pint: pint pints
celsius: celsius centigrade
fahrenheit: fahrenheit
kelvin: kelvin
minute: minute minutes
hour: hour hours
day: day days
week: week weeks
month: month months
year: year years
byte: byte bytes
kilobyte: kb kilobyte kilobytes
megabyte: mb megabyte megabytes
gigabyte: gb gigabyte gigabytes
terabyte: tb terabyte terabytes
watt: watt watts
kilowatt: kw kilowatt kilowatts
volt: volt volts
acre: acre acres
hectare: hectare hectares
calorie: calorie calories kcal
joule: joule joules
dollar: dollar dollars
euro: euro euros
second: seconds sec secs
knot: knot knots
bit: bit bits
psi: psi
pascal: pascal pascals pa
kilopascal: kpa
hectopascal: hpa hectopascal hectopascals
millibar: millibar millibars mbar
atmosphere: atm atmospheres
degree: degree degrees
radian: radian radians
nanometer: nanometer nanometers nm
micron: micron microns
ampere: amp amps ampere amperes
ohm: ohm ohms
hertz: hz hertz
kilohertz: khz
megahertz: mhz
gigahertz: ghz
btu: btu btus
kilowatt_hour: kwh
watt_hour: wh
decibel: decibel decibels db
lux: lux
lumen: lumen lumens
carat: carat carats
grain: grain grains
fathom: fathom fathoms
furlong: furlong furlongs
league: league leagues
quarter: quarter quarters
"""
)

NEGATIONS = _wordset("""
never no nothing cannot none not without nor nobody nowhere neither
""")

# Each line: one pair of opposites, each side a few words that mean the same. A word may
# stand in several pairs (toxic is the opposite of safe and of edible).
OPPOSITES = _pairs(
    """
pros advantages advantage benefits benefit upsides upside good | cons disadvantages disadvantage drawbacks drawback downsides downside risks risk dangers bad
increase increases raise raising higher more gain boost | decrease decreases lower lowering reduce less lose
before earlier prior | after later
today | tomorrow yesterday
start begin beginning starting opening opens open | end stop ending finish closing closes close
enable turn_on activate | disable turn_off deactivate
add insert | remove delete
buy purchase buying | sell selling
import | export
upload | download
encrypt | decrypt
encode | decode
compress zip | decompress unzip extract
push | pull
lock | unlock
install | uninstall
show unhide reveal | hide
join | leave
win won | lose lost
hot hottest warm warmest | cold coldest cool
safe edible harmless | unsafe dangerous toxic poisonous harmful
legal | illegal
healthy | unhealthy
possible | impossible
minimum min smallest lowest least | maximum max largest highest most biggest
sum addition total | product multiply multiplication
subtract minus | divide
area | perimeter circumference volume
singular | plural
present | past future
north northern | south southern
east eastern | west western
input | output
inside indoor indoors | outside outdoor outdoors
long longer longest | short shorter shortest
fast faster fastest quick | slow slower slowest
big bigger large larger | small smaller tiny
heavy heavier | light lighter
cheap cheaper cheapest | expensive pricier
better best | worse worst
true | false
positive | negative
odd | even
wet | dry
male men man boys | female women woman girls
old older oldest | young younger youngest new newer newest
arrive arrival | depart departure leave
send sending | receive receiving
borrow | lend
rise sunrise | set sunset
morning | evening night
summer | winter
spring | autumn fall
weekday weekdays | weekend weekends
cause causes | cure cures treat treatment prevent
eat | avoid
allowed permitted | forbidden banned prohibited
accept | reject
left | right
top | bottom
upstairs uphill upward | downstairs downhill downward
log_in login sign_in signin | log_out logout sign_out signout
last final | first
"""
)

SIDES: dict[str, list[tuple[int, int]]] = {}
for _group, _pair in enumerate(OPPOSITES):
    for _side, _words in enumerate(_pair):
        for _w in _words.split():
            SIDES.setdefault(_w.replace("_", " "), []).append((_group, _side))

SMALL = _numbers("""
zero=0 one=1 two=2 three=3 four=4 five=5 six=6 seven=7 eight=8 nine=9 ten=10 eleven=11
twelve=12 thirteen=13 fourteen=14 fifteen=15 sixteen=16 seventeen=17 eighteen=18 nineteen=19
twenty=20 thirty=30 forty=40 fifty=50 sixty=60 seventy=70 eighty=80 ninety=90 dozen=12
""")
ORDINALS = _numbers("""
second=2 third=3 fourth=4 fifth=5 sixth=6 seventh=7 eighth=8 ninth=9 tenth=10 twelfth=12
twentieth=20 hundredth=100
""")
ROMAN = _numbers("""
II=2 III=3 IV=4 V=5 VI=6 VII=7 VIII=8 IX=9 X=10
""")
DECADES = _numbers("""
twenties=1920 thirties=1930 forties=1940 fifties=1950 sixties=1960 seventies=1970
eighties=1980 nineties=1990
""")
SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
# Several names of one thing (compared as one).
ALIASES = _names(
    """
usa: usa us u.s. america american americans united_states united_states_of_america
uk: uk britain british united_kingdom great_britain
eu: eu european_union
un: un united_nations
japan: japan japanese
china: china chinese
france: france french
germany: germany german
italy: italy italian
spain: spain spanish
india: india indian
canada: canada canadian
mexico: mexico mexican
russia: russia russian
australia: australia australian
brazil: brazil brazilian
korea: korea korean
new_york: nyc new_york_city
dictionary: dict
javascript: js
"""
)

# Words that make a unit another unit (a nautical mile is no mile).
UNIT_KINDS = _wordset(
    "nautical square cubic fluid imperial metric troy light statute short long us"
)
# Names written in lowercase: the chemical elements.
LOWER_NAMES = _wordset("""hydrogen helium lithium beryllium boron carbon nitrogen oxygen fluorine neon
sodium magnesium aluminum aluminium silicon phosphorus sulfur sulphur chlorine argon potassium
calcium titanium chromium manganese iron cobalt nickel copper zinc gallium germanium arsenic
selenium bromine krypton rubidium strontium zirconium silver tin iodine xenon cesium barium
tungsten platinum gold mercury lead radon radium uranium plutonium""")
# Words that only say what kind of thing a name is (Heathrow Airport = Heathrow).
GENERIC = _wordset("""
airport city station university river lake mountain mount street avenue park inc corp company
island islands
""")
# What the two sides of a direction stand around.
DIRECTIONS = {"to", "into", "than", "minus", "by", "over", "versus", "vs"}
FILLER = _wordset("""a an the my your our their his her its this that these those some of for in on
at per and or is are be it""")

# Words too common to say what a question is about (wh-words stay: when / where differ).
STOP = FILLER | _wordset("""do does did can could should would will shall may might must i
you me we us get got have has had to from with about as into onto be been being am was were
there here so then just please also very really what which explain define describe
tell list name give show mean means meaning exactly""")
# Words that mean the same in a question (one group a line).
SYNONYM_GROUPS = """
why reason cause caused causes make makes made
how way ways steps method can
world earth planet globe
delete remove erase
main central primary key chief
wrote write written author authored
use using used work works working
vs versus difference differ compare
big large huge
small little tiny
fast quick quickly rapid
car auto automobile vehicle
pc computer laptop
kid child children
mom mother
dad father
buy purchase
fix repair
begin start
end finish
need require required
good fine okay ok
help assist
build construct constructed built
invent invented create created
job work career
doctor physician
film movie
show display
get obtain
find locate
make cook prepare brew
home homemade house
""".strip().splitlines()
SYNONYM = {w: g for g, line in enumerate(SYNONYM_GROUPS) for w in line.split()}
# Capitalised words that name nothing (a question's opener, a sentence's first word).
OPENERS = _wordset("""how what whats what's which who whom whose why where when is are was were do does
did can could should would will shall may might must any tell give explain describe list name
show find convert compare i im i'm my it in on at for from to the a an if please help quick hey hi
best easiest recommend tips ways way""")
