"""Generate the chat-style prompt sets shipped with vskipper (run once; the outputs are committed).

chat.jsonl       templated everyday requests (chat), short facts and arithmetic, the kinds the
                 quality evaluation asks; the training split of the self-distillation set is
                 every record whose id number is not a multiple of 5 (vskipper/training/data.py)
everyday.jsonl   hand-written everyday chat prompts, never trained on: the held-out prompts of
                 the greedy-agreement check (not templated, so they test more than the templates)
facts_mc.jsonl   multiple-choice short facts (capitals, continents, opposites, plurals, animal
                 legs, arithmetic), for the loglikelihood task; facts written here from common
                 knowledge, distractors drawn from the same lists

Every record: {"id", "kind", "prompt", "answer"} (chat answers are ""); multiple-choice records
also carry "choices" (list of strings) and "gold" (index). Deterministic:
python -m vskipper.data.make_chat rewrites the same files."""
from __future__ import annotations

import json
import random
from pathlib import Path

from vskipper.data.make_prompts import arithmetic, word_problem


def _countries(table: str) -> list[tuple[str, str, str]]:
    """(country, capital, continent) from lines `continent: country/capital; country/capital; ...`."""
    rows = []
    for line in table.strip().splitlines():
        continent, pairs = line.strip().split(": ")
        for pair in pairs.split("; "):
            country, capital = pair.split("/")
            rows.append((country, capital, continent))
    return rows


# (country, capital, continent); keep the order: the committed .jsonl files were drawn from this list
COUNTRIES = _countries("""
    Europe: France/Paris; Germany/Berlin; Italy/Rome; Spain/Madrid; Portugal/Lisbon; Greece/Athens; Poland/Warsaw
    Europe: Austria/Vienna; Sweden/Stockholm; Norway/Oslo; Finland/Helsinki; Denmark/Copenhagen; Ireland/Dublin
    Europe: Hungary/Budapest; Belgium/Brussels; the Netherlands/Amsterdam; Russia/Moscow; Ukraine/Kyiv
    Asia: Japan/Tokyo; China/Beijing; India/New Delhi; South Korea/Seoul; Thailand/Bangkok; Vietnam/Hanoi
    Asia: Indonesia/Jakarta; the Philippines/Manila; Iran/Tehran; Turkey/Ankara; Saudi Arabia/Riyadh; Pakistan/Islamabad
    Africa: Egypt/Cairo; Kenya/Nairobi; Nigeria/Abuja; Ethiopia/Addis Ababa; Morocco/Rabat
    Africa: Ghana/Accra; Senegal/Dakar; Uganda/Kampala; Tanzania/Dodoma
    North America: Canada/Ottawa; Mexico/Mexico City; the United States/Washington, D.C.; Cuba/Havana; Jamaica/Kingston
    South America: Brazil/Brasilia; Argentina/Buenos Aires; Chile/Santiago; Peru/Lima
    South America: Colombia/Bogota; Venezuela/Caracas
    Oceania: Australia/Canberra; New Zealand/Wellington; Fiji/Suva
""")
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("up", "down"), ("open", "closed"), ("early", "late"), ("full", "empty"), ("old", "young"),
             ("strong", "weak"), ("hard", "soft"), ("wet", "dry"), ("rich", "poor"), ("loud", "quiet"),
             ("high", "low"), ("clean", "dirty"), ("true", "false"), ("long", "short"), ("heavy", "light"),
             ("inside", "outside"), ("begin", "end"), ("buy", "sell"), ("win", "lose"), ("push", "pull"),
             ("thick", "thin"), ("near", "far"), ("safe", "dangerous"), ("cheap", "expensive"), ("day", "night")]
PLURALS = [("child", "children"), ("mouse", "mice"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
           ("man", "men"), ("woman", "women"), ("person", "people"), ("leaf", "leaves"), ("knife", "knives"),
           ("box", "boxes"), ("city", "cities"), ("baby", "babies"), ("bus", "buses"), ("wolf", "wolves"),
           ("potato", "potatoes"), ("fish", "fish"), ("sheep", "sheep"), ("cactus", "cacti"), ("ox", "oxen")]
LEGS = [("spider", 8), ("dog", 4), ("cat", 4), ("chicken", 2), ("ant", 6), ("horse", 4), ("bee", 6),
        ("duck", 2), ("octopus", 8), ("cow", 4), ("butterfly", 6), ("ostrich", 2), ("crab", 10), ("snake", 0),
        ("fish", 0), ("penguin", 2), ("lion", 4), ("beetle", 6), ("scorpion", 8), ("frog", 4)]

ACTIVITIES = ["learning to cook", "running a first marathon", "studying for exams", "saving money",
              "starting a vegetable garden", "sleeping better", "learning a new language", "working from home",
              "keeping a houseplant alive", "speaking in public", "traveling on a budget", "making new friends",
              "reading more books", "staying focused", "learning to draw", "moving to a new city",
              "taking better photos", "writing a diary", "drinking more water", "cleaning the kitchen"]
CONCEPTS = ["photosynthesis", "gravity", "inflation", "the water cycle", "electricity", "a black hole",
            "democracy", "the internet", "vaccines", "climate change", "machine learning", "compound interest",
            "the seasons", "rainbows", "earthquakes", "recycling", "a volcano", "the moon's phases",
            "evolution", "the immune system", "supply and demand", "a computer program", "sound waves", "tides"]
THINGS = ["the ocean", "autumn leaves", "a rainy day", "friendship", "the city at night", "a cup of tea",
          "mountains", "an old library", "the first snow", "a lazy cat", "the stars", "a summer garden",
          "a train journey", "morning coffee", "the desert", "a lighthouse"]
FOODS = ["rice", "potatoes", "eggs", "chickpeas", "spinach", "pasta", "lentils", "tomatoes", "bananas",
         "oats", "mushrooms", "carrots", "tofu", "apples", "bread", "cheese"]
TASKS = ["make a paper airplane", "boil an egg", "change a flat tire", "write a resume", "tie a tie",
         "plant a tree", "make a budget", "bake bread", "clean a laptop keyboard", "start a podcast",
         "fold a shirt neatly", "make a cup of tea", "learn to juggle", "set up a fish tank",
         "prepare for a job interview", "organize a closet", "brew coffee without a machine", "fix a squeaky door"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a sea"), ("a frog", "a toad"),
         ("speed", "velocity"), ("a crocodile", "an alligator"), ("baking soda", "baking powder"),
         ("a moth", "a butterfly"), ("RAM", "storage"), ("a hurricane", "a tornado"), ("an ape", "a monkey"),
         ("a poem", "a song"), ("a fruit", "a vegetable"), ("a star", "a planet"), ("an email", "a letter")]
PEOPLE_EVENTS = [("my manager", "taking a day off next Friday"), ("my neighbor", "a party on Saturday"),
                 ("a friend", "a trip we are planning"), ("my teacher", "missing class tomorrow"),
                 ("my landlord", "a broken heater"), ("the team", "the new meeting time"),
                 ("my grandmother", "her birthday"), ("a client", "a delayed delivery")]
ANIMALS = ["octopuses", "elephants", "penguins", "owls", "dolphins", "bees", "giraffes", "sloths", "cats",
           "crows", "sharks", "turtles", "kangaroos", "hummingbirds", "ants", "wolves"]
PLACES = ["Paris", "a tropical beach", "the mountains in winter", "a busy market", "Japan", "a quiet village",
          "the Sahara desert", "New York", "a rainforest", "Iceland", "a small island", "Rome"]
PHENOMENA = ["the sky blue", "the sea salty", "ice slippery", "the sun hot", "bread soft after baking",
             "a rainbow curved", "grass green", "the moon visible during the day", "a cut apple brown after a while"]
SKILLS = ["handwriting", "memory", "typing speed", "chess game", "singing voice", "posture", "cooking",
          "time management", "drawing", "writing"]
WORDS = ["cat", "light", "tree", "sun", "book", "rain", "day", "song", "blue", "ring", "star", "cake"]
EVENTS = ["birthday party", "picnic", "game night", "family dinner", "weekend trip", "book club meeting",
          "garden party", "movie night"]

CHAT = [
    ("Explain {c} in simple terms.", "concept"),
    ("What are three tips for {a}?", "activity"),
    ("Write a short poem about {t}.", "thing"),
    ("Give me a simple recipe idea using {f}.", "food"),
    ("How do I {k}?", "task"),
    ("What is the difference between {p0} and {p1}?", "pair"),
    ("Write a short, friendly email to {e0} about {e1}.", "event"),
    ("What are the benefits of {a}?", "activity"),
    ("Tell me a fun fact about {n}.", "animal"),
    ("Describe {l} in two sentences.", "place"),
    ("Why is {ph}?", "phenomenon"),
    ("How can I improve my {s}?", "skill"),
    ("List five words that rhyme with '{w}'.", "word"),
    ("Can you help me plan a {v}?", "plan"),
    ("Write a haiku about {t}.", "thing"),
    ("What should I pack for a trip to {l}?", "place"),
    ("Give me a motivational sentence about {a}.", "activity"),
    ("Explain {c} to a ten-year-old.", "concept"),
    ("What is a good way to remember to {k}?", "task"),
    ("I am bored. Suggest three things to do related to {a}.", "activity"),
]
STYLES = ["", " Keep it short.", " Please answer in one paragraph.", " I am a complete beginner.",
          " Use a numbered list.", " Explain your reasoning.", " Be friendly and encouraging.", " Answer briefly.",
          " Give an example.", " Thanks!"]
FACTS = [
    ("What is the capital of {country}?", lambda c: c[1]),
    ("Which continent is {country} in?", lambda c: c[2]),
]


def chat(r: random.Random) -> str:
    template = r.choice(CHAT)[0] + r.choice(STYLES)
    p, e = r.choice(PAIRS), r.choice(PEOPLE_EVENTS)
    return template.format(c=r.choice(CONCEPTS), a=r.choice(ACTIVITIES), t=r.choice(THINGS), f=r.choice(FOODS),
                           k=r.choice(TASKS), p0=p[0], p1=p[1], e0=e[0], e1=e[1], n=r.choice(ANIMALS),
                           l=r.choice(PLACES), ph=r.choice(PHENOMENA), s=r.choice(SKILLS), w=r.choice(WORDS),
                           v=r.choice(EVENTS))


def half(items: list, evaluated: bool) -> list:
    """The entries the multiple-choice task asks about (even positions) or the others, which the
    training prompts ask about: no fact is both trained on and evaluated."""
    return items[0 if evaluated else 1::2]


def fact(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(5)
    if kind <= 1:
        template, answer = FACTS[kind]
        c = r.choice(half(COUNTRIES, False))
        return template.format(country=c[0]), answer(c)
    if kind == 2:
        a, b = r.choice(half(OPPOSITES, False))
        return f"What is the opposite of '{a}'?", b
    if kind == 3:
        s, p = r.choice(half(PLURALS, False))
        return f"What is the plural of '{s}'?", p
    n, legs = r.choice(half(LEGS, False))
    return f"How many legs does a {n} have?", str(legs)


# Hand-written, never templated, never trained on.
EVERYDAY = [
    "What's a good name for a golden retriever puppy?",
    "Can you recommend a book for a long flight?",
    "How do I get rid of the smell in my fridge?",
    "I have an interview tomorrow. Any advice?",
    "Write a birthday message for my sister.",
    "What are some easy exercises I can do at my desk?",
    "How long should I boil pasta?",
    "Why do cats purr?",
    "Give me an idea for a weekend project with my kids.",
    "What's the best way to learn to type faster?",
    "How can I tell if an avocado is ripe?",
    "Write a thank-you note to a coworker who helped me.",
    "What should I do if my phone gets wet?",
    "Suggest a healthy breakfast that takes five minutes.",
    "How do airplanes stay in the air?",
    "What is a good habit to start this month?",
    "Explain what a mortgage is.",
    "Why do leaves change color in the fall?",
    "How do I politely decline an invitation?",
    "What's a fun fact about the moon?",
    "How much water should I drink in a day?",
    "Write a two-line poem about coffee.",
    "What can I cook with leftover rice?",
    "How do I start running if I've never run before?",
    "What is the difference between a hobby and a passion?",
    "Give me three ideas for a rainy afternoon.",
    "How do I make my houseplants grow faster?",
    "Why is it important to sleep well?",
    "What's a simple way to save money on groceries?",
    "Help me write a short bio for my social media profile.",
    "How do bees make honey?",
    "What should I know before adopting a cat?",
    "Tell me a short joke about computers.",
    "How can I be more productive in the morning?",
    "What does a good friend do?",
    "Write a short story opening about a lost key.",
    "How do I clean a cast iron pan?",
    "What is the tallest mountain in the world?",
    "How do I calm down before a big presentation?",
    "Suggest a name for a small bakery.",
    "What are the planets in our solar system?",
    "Why do we yawn?",
    "Give me a tip for remembering people's names.",
    "How do I make a good cup of coffee at home?",
    "What is a healthy snack for the afternoon?",
    "Describe a perfect summer day.",
    "How do I write a good to-do list?",
    "What's the best way to learn a musical instrument as an adult?",
    "Why is exercise good for the brain?",
    "Write a polite message asking my neighbor to turn down the music.",
    "How do rainbows form?",
    "What should I pack for a beach day?",
    "How do I keep my laptop battery healthy?",
    "What's an easy dessert I can make without an oven?",
    "Explain why the ocean has waves.",
    "Give me a short pep talk before my exam.",
    "What are some good questions to ask on a first date?",
    "How do I stop procrastinating?",
    "What is the fastest land animal?",
    "How do I choose a good watermelon?",
]


def mc_items(r: random.Random) -> list[dict]:
    """Multiple-choice items: question, 4 choices (the gold one and 3 distractors from the same list)."""
    items = []

    def add(kind, prompt, gold, pool):
        others = r.sample([x for x in dict.fromkeys(pool) if x != gold], 3)
        choices = others + [gold]
        r.shuffle(choices)
        items.append({"kind": kind, "prompt": prompt, "answer": gold, "choices": choices,
                      "gold": choices.index(gold)})

    capitals = [c[1] for c in COUNTRIES]
    continents = sorted({c[2] for c in COUNTRIES})
    for c in half(COUNTRIES, True):
        add("capital", f"What is the capital of {c[0]}?", c[1], capitals)
        add("continent", f"Which continent is {c[0]} in?", c[2], continents)
    for a, b in half(OPPOSITES, True):
        add("opposite", f"What is the opposite of '{a}'?", b, [x for p in OPPOSITES for x in p if a not in p])
    for s, p in half(PLURALS, True):
        add("plural", f"What is the plural of '{s}'?", p,
            [p, s, s + "s", s + "es"] + [q for _, q in PLURALS if q != p])
    for n, legs in half(LEGS, True):
        add("legs", f"How many legs does a {n} have?", str(legs), [str(x) for x in (0, 2, 4, 6, 8, 10)])
    for _ in range(250):
        q, a = arithmetic(r)
        add("arithmetic", q, str(a), [str(a + d) for d in (-10, -2, -1, 1, 2, 10) if a + d >= 0])
    r.shuffle(items)
    return [{"id": f"m{i:03d}", **it} for i, it in enumerate(items)]


def main() -> None:
    here = Path(__file__).parent
    with open(here / "facts_mc.jsonl", "w") as f:
        for row in mc_items(random.Random(5)):
            f.write(json.dumps(row) + "\n")
    r = random.Random(20261202)
    rows = []
    for _ in range(3000):
        u = r.random()
        if u < 0.7:
            rows.append({"kind": "chat", "prompt": chat(r), "answer": ""})
        elif u < 0.8:
            q, a = fact(r)
            rows.append({"kind": "fact", "prompt": q, "answer": a})
        else:
            q, a = word_problem(r) if r.random() < 0.5 else arithmetic(r)
            rows.append({"kind": "arithmetic", "prompt": q, "answer": str(a)})
    evaluated = {json.loads(line)["prompt"] for name in ("arithmetic.jsonl", "facts_mc.jsonl")
                 for line in (here / name).read_text().splitlines()}
    seen, unique = set(evaluated), []  # nothing the evaluation asks is trained on
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            unique.append(row)
    with open(here / "chat.jsonl", "w") as f:
        for i, row in enumerate(unique):
            f.write(json.dumps({"id": f"c{i:04d}", **row}) + "\n")
    with open(here / "everyday.jsonl", "w") as f:
        for i, p in enumerate(EVERYDAY):
            f.write(json.dumps({"id": f"e{i:03d}", "kind": "chat", "prompt": p, "answer": ""}) + "\n")


if __name__ == "__main__":
    main()
