"""Multiple-choice questions a 135M model answers well above chance, for judging a change by lm-eval's metrics.

`eval_mc.py`'s default questions are random words: SmolLM2-135M answers them at chance (0.27 against 0.25), its
pick is a near tie on most of them, so any rounding (FP8 KV, issue 40) flips a pick at random and the metric moves
by about a point whichever way. These are facts and patterns the model has seen (capitals, opposites, the number
after n, ...), scored as lm-eval scores ARC or HellaSwag: each choice's own text is the continuation (no letters),
so a question's four continuations differ and run several tokens after the shared context.

Eight subjects, each a generator of (question, choices, answer) from tables below or from arithmetic; a question is
never repeated within a subject, and the right choice's position is drawn at random.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

Question = tuple[str, list[str], int]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens",
    "England": "London", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Switzerland": "Bern", "Turkey": "Ankara", "India": "New Delhi",
    "Thailand": "Bangkok", "South Korea": "Seoul", "Indonesia": "Jakarta", "the Philippines": "Manila",
    "Vietnam": "Hanoi", "Iran": "Tehran", "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Israel": "Jerusalem",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Morocco": "Rabat", "Ghana": "Accra",
    "Canada": "Ottawa", "the United States": "Washington", "Mexico": "Mexico City", "Cuba": "Havana",
    "Argentina": "Buenos Aires", "Brazil": "Brasilia", "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Australia": "Canberra", "New Zealand": "Wellington", "Ukraine": "Kyiv",
    "the Czech Republic": "Prague", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Iceland": "Reykjavik", "Scotland": "Edinburgh", "Wales": "Cardiff",
    "Pakistan": "Islamabad", "Afghanistan": "Kabul", "Nepal": "Kathmandu", "Bangladesh": "Dhaka",
    "Malaysia": "Kuala Lumpur", "Singapore": "Singapore", "Lebanon": "Beirut", "Syria": "Damascus",
    "Jordan": "Amman", "Qatar": "Doha", "Cyprus": "Nicosia", "Malta": "Valletta", "Estonia": "Tallinn",
    "Latvia": "Riga", "Lithuania": "Vilnius",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "light": "dark", "old": "new",
    "open": "closed", "early": "late", "full": "empty", "hard": "soft", "high": "low", "long": "short",
    "rich": "poor", "strong": "weak", "wet": "dry", "young": "old", "loud": "quiet", "thick": "thin",
    "heavy": "light", "clean": "dirty", "cheap": "expensive", "day": "night", "black": "white", "north": "south",
    "east": "west", "left": "right", "inside": "outside", "begin": "end", "buy": "sell", "win": "lose",
    "push": "pull", "give": "take", "laugh": "cry", "love": "hate", "friend": "enemy", "true": "false",
    "always": "never", "before": "after", "above": "below", "first": "last", "top": "bottom", "front": "back",
    "sweet": "sour", "safe": "dangerous", "easy": "difficult", "right": "wrong", "good": "bad", "near": "far",
    "deep": "shallow", "wide": "narrow", "smooth": "rough", "sharp": "blunt", "alive": "dead", "arrive": "leave",
    "accept": "refuse", "remember": "forget", "question": "answer", "increase": "decrease", "summer": "winter",
    "king": "queen", "boy": "girl", "man": "woman", "brother": "sister", "father": "mother", "husband": "wife",
    "war": "peace", "floor": "ceiling", "sunrise": "sunset", "minimum": "maximum", "success": "failure",
    "visible": "invisible", "possible": "impossible",
}
PLURALS = {
    "mouse": "mice", "child": "children", "man": "men", "woman": "women", "tooth": "teeth", "foot": "feet",
    "goose": "geese", "person": "people", "ox": "oxen", "cactus": "cacti", "knife": "knives", "wife": "wives",
    "leaf": "leaves", "wolf": "wolves", "half": "halves", "shelf": "shelves", "loaf": "loaves", "life": "lives",
    "box": "boxes", "fox": "foxes", "bus": "buses", "church": "churches", "dish": "dishes", "watch": "watches",
    "city": "cities", "baby": "babies", "party": "parties", "story": "stories", "lady": "ladies",
    "country": "countries", "family": "families", "berry": "berries", "puppy": "puppies", "hero": "heroes",
    "potato": "potatoes", "tomato": "tomatoes", "echo": "echoes", "cat": "cats", "dog": "dogs", "book": "books",
    "tree": "trees", "house": "houses", "car": "cars", "bird": "birds", "chair": "chairs", "table": "tables",
    "apple": "apples", "window": "windows", "river": "rivers", "song": "songs", "day": "days", "toy": "toys",
    "key": "keys", "boy": "boys", "monkey": "monkeys", "glass": "glasses", "class": "classes", "kiss": "kisses",
    "brush": "brushes", "match": "matches", "beach": "beaches", "dress": "dresses", "crisis": "crises",
    "analysis": "analyses", "thesis": "theses", "phenomenon": "phenomena", "criterion": "criteria",
    "fungus": "fungi", "nucleus": "nuclei", "radius": "radii", "louse": "lice", "sheep": "sheep",
    "deer": "deer", "fish": "fish",
}
CATEGORIES = {
    "fruit": ["apple", "banana", "orange", "grape", "pear", "cherry", "peach", "lemon", "mango", "plum"],
    "animal": ["dog", "cat", "horse", "lion", "tiger", "rabbit", "elephant", "monkey", "cow", "sheep"],
    "colour": ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white"],
    "vehicle": ["car", "bus", "train", "bicycle", "truck", "airplane", "boat", "motorcycle", "taxi", "tram"],
    "tool": ["hammer", "saw", "screwdriver", "wrench", "drill", "shovel", "axe", "chisel", "pliers", "rake"],
    "musical instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "cello", "harp", "clarinet",
                           "saxophone"],
    "piece of furniture": ["chair", "table", "sofa", "bed", "desk", "wardrobe", "bookshelf", "stool", "dresser",
                           "bench"],
    "body part": ["hand", "foot", "head", "arm", "leg", "nose", "ear", "eye", "knee", "elbow"],
}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _among_others(rng: random.Random, right: str, others: list[str]) -> tuple[list[str], int]:
    """The right choice among three others, at a random position."""
    choices = rng.sample(others, 3)
    answer = rng.randrange(4)
    choices.insert(answer, right)
    return choices, answer


def capitals(rng: random.Random) -> Iterator[Question]:
    for country in rng.sample(list(CAPITALS), len(CAPITALS)):
        others = [c for k, c in CAPITALS.items() if k != country]
        yield (f"What is the capital city of {country}?", *_among_others(rng, CAPITALS[country], others))


def opposites(rng: random.Random) -> Iterator[Question]:
    for word in rng.sample(list(OPPOSITES), len(OPPOSITES)):
        right = OPPOSITES[word]
        others = sorted({w for w in OPPOSITES.values() if w not in (right, word)})
        yield (f"What is the opposite of the word \"{word}\"?", *_among_others(rng, right, others))


def plurals(rng: random.Random) -> Iterator[Question]:
    for word in rng.sample(list(PLURALS), len(PLURALS)):
        right = PLURALS[word]
        wrong = {word + "s", word + "es", word + "en", word[:-1] + "ies", word + "ses", word + "i"} - {right}
        yield (f"What is the plural of \"{word}\"?", *_among_others(rng, right, sorted(wrong)))


def categories(rng: random.Random) -> Iterator[Question]:
    seen = set()
    while True:
        kind = rng.choice(list(CATEGORIES))
        right = rng.choice(CATEGORIES[kind])
        others = sorted({w for k, words in CATEGORIES.items() if k != kind for w in words} - set(CATEGORIES[kind]))
        if (kind, right) not in seen:
            seen.add((kind, right))
            yield (f"Which of these is a {kind}?", *_among_others(rng, right, others))


def addition(rng: random.Random) -> Iterator[Question]:
    seen = set()
    while True:
        a, b = rng.randrange(1, 30), rng.randrange(1, 30)
        if (a, b) not in seen:
            seen.add((a, b))
            wrong = [str(a + b + d) for d in (-10, -2, -1, 1, 2, 10) if a + b + d > 0]
            yield (f"What is {a} plus {b}?", *_among_others(rng, str(a + b), wrong))


def next_number(rng: random.Random) -> Iterator[Question]:
    for n in rng.sample(range(2, 200), 198):
        wrong = [str(n + d) for d in (-1, 2, 10, -10, 11) if n + d > 0]
        yield (f"Which number comes right after {n}?", *_among_others(rng, str(n + 1), wrong))


def sequences(rng: random.Random) -> Iterator[Question]:
    """The letter, month or day just after or just before a given one."""
    items = [(kind, seq, i, step) for kind, seq in (("letter", LETTERS), ("month", MONTHS), ("day", DAYS))
             for i in range(len(seq)) for step in (1, -1) if 0 <= i + step < len(seq)]
    for kind, seq, i, step in rng.sample(items, len(items)):
        where = "after" if step == 1 else "before"
        right = seq[i + step]
        others = [s for s in seq if s not in (right, seq[i])]
        noun = f"the letter {seq[i]} in the alphabet" if kind == "letter" else seq[i]
        yield (f"Which {kind} comes right {where} {noun}?", *_among_others(rng, right, others))


def largest(rng: random.Random) -> Iterator[Question]:
    seen = set()
    while True:
        numbers = rng.sample(range(1, 100), 4)
        if tuple(numbers) not in seen:
            seen.add(tuple(numbers))
            yield (f"Which number is the largest: {', '.join(map(str, numbers))}?", [str(n) for n in numbers],
                   numbers.index(max(numbers)))


SUBJECTS: dict[str, Callable[[random.Random], Iterator[Question]]] = {
    "capital cities": capitals, "opposites": opposites, "plurals": plurals, "categories": categories,
    "addition": addition, "counting": next_number, "sequences": sequences, "comparing numbers": largest,
}


def questions(subject: str, count: int, seed: int) -> list[Question]:
    """`count` distinct questions of a subject; refuses more than its tables hold."""
    made = list(zip(range(count), SUBJECTS[subject](random.Random(seed)), strict=False))
    if len(made) < count:
        raise SystemExit(f"the subject {subject!r} holds {len(made)} questions; ask for at most that many")
    return [q for _, q in made]
