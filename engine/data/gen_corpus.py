"""Regenerate ``corpus.txt``, the tokenizer training text shipped with pdserve.

The corpus is the hand-written ``prose.txt`` followed by sentences generated
from the word lists below with a fixed-seed PRNG, so the output is fully
deterministic.  Run ``python engine/data/gen_corpus.py`` after editing this
file or ``prose.txt``; the checked-in ``corpus.txt`` is what the tokenizer
trainer reads (this script is never run at model-making time).
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20240601
TARGET_BYTES = 300_000

NAMES = """Ada Tom Maya Daniel Sofia Liam Noah Emma Olivia Lucas Mia Ethan Chloe Omar Priya
Hiro Yuki Elena Marco Fatima Kwame Ingrid Pablo Nadia Arjun Leila Felix Greta Ivan Zara
Hannah Samuel Grace Victor Rosa Kenji Amara Jonas Clara Mateo Aisha Oscar Lena Tariq Iris
Bruno Freya Rahul Selma Theo Wen Julia Kofi Alma Dmitri Nora Paulo Esther Malik Ruth""".split()

PLACES = """London Paris Tokyo Nairobi Lima Oslo Cairo Sydney Toronto Mumbai Berlin Madrid
Seoul Lagos Vienna Dublin Prague Lisbon Athens Santiago Helsinki Manila Istanbul Accra Quito
Montreal Edinburgh Kyoto Marseille Porto Bergen Cork Hanoi Dakar Tunis Krakow Geneva""".split()

NOUNS = """apple river mountain garden window kitchen library teacher student doctor engineer
farmer painter musician bridge tunnel forest village city harbour island ocean desert valley
road train bicycle airplane ship boat letter book notebook pencil computer server network
message question answer problem solution story song poem picture camera phone clock lamp
table chair door wall roof floor stair tower castle market shop bakery school hospital
museum theatre station airport factory office meeting lecture concert festival holiday
breakfast lunch dinner soup bread cheese coffee tea water milk juice orange lemon carrot
potato onion tomato rice noodle cake cookie pie sandwich salad kettle blanket pillow jacket
sweater scarf glove boot shoe hat umbrella suitcase ticket passport map compass lantern
candle mirror basket bucket ladder hammer nail screw rope wire cable battery engine wheel
wing feather nest egg bird cat dog horse cow sheep goat rabbit fox wolf bear deer owl
eagle sparrow fish whale dolphin turtle frog bee butterfly spider ant snail tree flower
leaf branch root seed grass moss stone rock sand cloud rain snow storm wind thunder
lightning sun moon star planet comet galaxy universe atom molecule cell protein gene
virus bacteria energy force gravity light sound heat pressure temperature signal pattern
number equation theorem proof graph matrix vector function variable program algorithm
database query request response token model dataset benchmark experiment result report
budget contract invoice customer company market price cost profit worker manager team
project deadline plan goal idea dream memory habit skill lesson mistake chance reason
friend neighbour stranger family child parent brother sister cousin grandmother uncle
aunt captain pilot sailor soldier judge lawyer writer reader singer dancer player coach
referee winner champion journey adventure mystery secret surprise gift party wedding
birthday morning evening night afternoon week month year decade century season summer
winter spring autumn""".split()

ADJECTIVES = """quiet loud bright dark warm cold soft hard gentle rough smooth sharp dull quick
slow heavy light small large tiny huge narrow wide deep shallow tall short young old new
ancient modern simple complex strange familiar careful careless brave shy curious clever
honest patient busy lazy calm nervous happy sad tired hungry thirsty lucky proud kind
polite rude friendly lonely empty full clean dirty fresh stale sweet bitter salty sour
golden silver green blue red yellow purple orange grey white black pale vivid hidden
broken perfect ordinary unusual famous secret distant nearby early late rapid steady
fragile sturdy elegant clumsy noisy silent wooden metal glass paper plastic digital
electric remote local global private public rare common wild tame""".split()

ADVERBS = """quickly slowly carefully quietly loudly gently suddenly finally eventually rarely
often always never sometimes usually nearly almost barely clearly honestly happily sadly
eagerly calmly boldly softly patiently proudly warmly firmly silently easily""".split()

# (base, past, third person present, -ing)
VERBS = [
    ("walk", "walked", "walks", "walking"), ("carry", "carried", "carries", "carrying"),
    ("open", "opened", "opens", "opening"), ("close", "closed", "closes", "closing"),
    ("build", "built", "builds", "building"), ("find", "found", "finds", "finding"),
    ("lose", "lost", "loses", "losing"), ("paint", "painted", "paints", "painting"),
    ("read", "read", "reads", "reading"), ("write", "wrote", "writes", "writing"),
    ("watch", "watched", "watches", "watching"), ("cook", "cooked", "cooks", "cooking"),
    ("repair", "repaired", "repairs", "repairing"), ("sell", "sold", "sells", "selling"),
    ("buy", "bought", "buys", "buying"), ("visit", "visited", "visits", "visiting"),
    ("follow", "followed", "follows", "following"), ("measure", "measured", "measures", "measuring"),
    ("study", "studied", "studies", "studying"), ("explain", "explained", "explains", "explaining"),
    ("describe", "described", "describes", "describing"), ("remember", "remembered", "remembers", "remembering"),
    ("forget", "forgot", "forgets", "forgetting"), ("clean", "cleaned", "cleans", "cleaning"),
    ("draw", "drew", "draws", "drawing"), ("hide", "hid", "hides", "hiding"),
    ("share", "shared", "shares", "sharing"), ("move", "moved", "moves", "moving"),
    ("test", "tested", "tests", "testing"), ("check", "checked", "checks", "checking"),
    ("send", "sent", "sends", "sending"), ("receive", "received", "receives", "receiving"),
    ("count", "counted", "counts", "counting"), ("plant", "planted", "plants", "planting"),
    ("catch", "caught", "catches", "catching"), ("throw", "threw", "throws", "throwing"),
    ("borrow", "borrowed", "borrows", "borrowing"), ("return", "returned", "returns", "returning"),
    ("improve", "improved", "improves", "improving"), ("design", "designed", "designs", "designing"),
    ("collect", "collected", "collects", "collecting"), ("deliver", "delivered", "delivers", "delivering"),
    ("discover", "discovered", "discovers", "discovering"), ("compare", "compared", "compares", "comparing"),
    ("prepare", "prepared", "prepares", "preparing"), ("protect", "protected", "protects", "protecting"),
    ("notice", "noticed", "notices", "noticing"), ("choose", "chose", "chooses", "choosing"),
]

INTRANSITIVE = """arrived left laughed waited slept smiled listened wondered shouted whispered
danced sang travelled rested worked played hesitated agreed disagreed returned""".split()

CONNECTIVES = ["because", "although", "while", "after", "before", "until", "since", "so", "but", "and"]
TIMES = ["yesterday", "last week", "this morning", "at dawn", "after lunch", "in the evening",
         "on Monday", "on Friday", "in March", "in October", "every day", "once a year",
         "at midnight", "before sunrise", "during the storm", "in the spring", "last summer"]
PREPS = ["near", "behind", "under", "beside", "inside", "across", "beyond", "above", "below", "around"]
UNITS = ["metres", "kilometres", "grams", "kilograms", "litres", "seconds", "minutes", "hours",
         "days", "dollars", "euros", "percent", "degrees", "pages", "tokens", "requests"]
QUESTIONS = ["Where", "Why", "When", "How"]
FEELINGS = ["glad", "surprised", "worried", "curious", "certain", "sorry", "relieved", "amazed"]


ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p",
          "pr", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z", ""]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "th", "nd", "m", "x", "st"]
TOWN_SUFFIXES = ["", "", "ton", "field", "wick", "mouth", "ford", "dale", "by", "stead", "haven"]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class Gen:
    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def np(self) -> str:
        """A noun phrase, e.g. 'the quiet harbour' or 'a red kettle'."""
        noun = self.r.choice(NOUNS)
        if self.r.random() < 0.55:
            adj = self.r.choice(ADJECTIVES)
            det = self.r.choice(["the", article(adj), "this", "that", "her", "his", "our", "their"])
            return f"{det} {adj} {noun}"
        det = self.r.choice(["the", article(noun), "every", "my", "your", "one"])
        return f"{det} {noun}"

    def plural(self) -> str:
        noun = self.r.choice(NOUNS)
        if noun.endswith(("s", "sh", "ch", "x", "to")):
            return noun + "es"
        if noun.endswith("y") and noun[-2] not in "aeiou":
            return noun[:-1] + "ies"
        return noun + "s"

    def coin(self) -> str:
        """An invented proper noun built from syllables, e.g. 'Brelmor'."""
        n = 2 if self.r.random() < 0.75 else 3
        syl = [self.r.choice(ONSETS) + self.r.choice(VOWELS) + self.r.choice(CODAS) for _ in range(n)]
        return cap("".join(syl))

    def person(self) -> str:
        name = self.r.choice(NAMES)
        return f"{name} {self.coin()}" if self.r.random() < 0.35 else name

    def place(self) -> str:
        if self.r.random() < 0.35:
            return self.coin() + self.r.choice(TOWN_SUFFIXES)
        return self.r.choice(PLACES)

    def subject(self, start: bool = True) -> str:
        if self.r.random() < 0.5:
            return self.person()
        return cap(self.np()) if start else self.np()

    def number(self) -> str:
        kind = self.r.random()
        if kind < 0.4:
            return str(self.r.randint(0, 100))
        if kind < 0.7:
            return str(self.r.randint(100, 99999))
        if kind < 0.85:
            return f"{self.r.uniform(0, 1000):.{self.r.randint(1, 3)}f}"
        return f"{self.r.randint(1000, 9_999_999):,}"

    def sentence(self) -> str:
        r = self.r
        base, past, third, ing = r.choice(VERBS)
        k = r.randrange(16)
        if k == 0:
            s = f"{self.subject()} {past} {self.np()} {r.choice(TIMES)}."
        elif k == 1:
            s = f"{self.subject()} {third} {self.np()} {r.choice(ADVERBS)}."
        elif k == 2:
            s = f"{self.subject()} was {ing} {self.np()} {r.choice(PREPS)} {self.np()}."
        elif k == 3:
            s = (f"{self.subject()} {r.choice(INTRANSITIVE)} {r.choice(CONNECTIVES)} "
                 f"{self.np()} was {r.choice(ADJECTIVES)}.")
        elif k == 4:
            s = f"{r.choice(QUESTIONS)} did {self.person()} {base} {self.np()}?"
        elif k == 5:
            s = f'"I will {base} {self.np()} tomorrow," said {self.person()}.'
        elif k == 6:
            s = (f"There were {self.number()} {self.plural()} {r.choice(PREPS)} {self.np()}, "
                 f"and {self.person()} {past} all of them.")
        elif k == 7:
            s = (f"The {r.choice(NOUNS)} in {self.place()} is about {self.number()} "
                 f"{r.choice(UNITS)} from the {r.choice(NOUNS)}.")
        elif k == 8:
            s = (f"{self.person()} was {r.choice(FEELINGS)} to {base} {self.np()}, "
                 f"{r.choice(CONNECTIVES)} {self.person()} {r.choice(INTRANSITIVE)}.")
        elif k == 9:
            a, b = r.randint(2, 999), r.randint(2, 999)
            op, val = r.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
            s = f"{a} {op} {b} equals {val}."
        elif k == 10:
            items = [self.plural() for _ in range(r.randint(2, 5))]
            s = f"For the trip {self.person()} packed {', '.join(items[:-1])} and {items[-1]}."
        elif k == 11:
            s = f"{cap(r.choice(ADVERBS))}, {self.np()} became {r.choice(ADJECTIVES)} and {r.choice(ADJECTIVES)}."
        elif k == 12:
            s = (f"If you {base} {self.np()}, then {self.np()} {r.choice(['will', 'might', 'should', 'can'])} "
                 f"{r.choice(VERBS)[0]} {self.np()}.")
        elif k == 13:
            s = (f"In {r.randint(1700, 2030)}, {self.person()} {r.choice(['moved', 'travelled', 'wrote'])} "
                 f"to {self.place()} with {self.np()}.")
        elif k == 14:
            s = (f"Q: How many {self.plural()} does {self.person()} have? "
                 f"A: {self.person()} has {self.number()}.")
        else:
            s = (f"{cap(self.np())} is {r.choice(['more', 'less'])} {r.choice(ADJECTIVES)} "
                 f"than {self.np()}, {r.choice(['but', 'and', 'so'])} {self.subject(start=False)} {past} it anyway.")
        return s

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.r.randint(3, 8)))

    def block(self) -> str:
        r = self.r
        k = r.randrange(10)
        if k == 0:  # a small list
            head = f"Things {self.person()} needs from the {r.choice(NOUNS)}:"
            lines = [f"{i + 1}. {cap(self.np())}" for i in range(r.randint(3, 6))]
            return "\n".join([head, *lines])
        if k == 1:  # a tiny key/value record
            name = self.person()
            return (f"name: {name}\ncity: {self.place()}\nage: {r.randint(18, 90)}\n"
                    f"id: {r.randint(10000, 99999)}-{r.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}")
        if k == 3:  # invented places and people
            town, river, person = self.coin(), self.coin(), f"{self.r.choice(NAMES)} {self.coin()}"
            return (f"The town of {town} lies on the {river} river, {self.number()} {r.choice(UNITS)} "
                    f"from {self.place()}. {person} {r.choice(VERBS)[1]} {self.np()} there "
                    f"{r.choice(TIMES)}, and the people of {town} still {r.choice(VERBS)[0]} it. "
                    + self.sentence())
        if k == 2:  # a code-like snippet
            var, fn = r.choice(NOUNS), r.choice(VERBS)[0]
            return (f"def {fn}_{var}({var}s, limit={r.randint(1, 64)}):\n"
                    f"    result = []\n    for {var} in {var}s[:limit]:\n"
                    f"        result.append({var})\n    return result")
        return self.paragraph()


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def build() -> str:
    prose = (HERE / "prose.txt").read_text(encoding="utf-8")
    gen = Gen(random.Random(SEED))
    parts = [prose.rstrip("\n")]
    size = len(prose.encode("utf-8"))
    while size < TARGET_BYTES:
        block = gen.block()
        parts.append(block)
        size += len(block.encode("utf-8")) + 2
    return "\n\n".join(parts) + "\n"


def main() -> None:
    text = build()
    (HERE / "corpus.txt").write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode('utf-8'))} bytes to {HERE / 'corpus.txt'}")


if __name__ == "__main__":
    main()
