"""Generate the prompt sets shipped with vskipper (run once; the outputs are committed).

prompts.jsonl     serving / self-distillation prompts: arithmetic word problems and short
                  reasoning questions in the spirit of GSM8K and BBH (written here, not copied)
arithmetic.jsonl  questions with checkable integer answers, for quality measurements

Every record: {"id", "kind", "prompt", "answer"} (answer is a string; "" when not checkable).
Deterministic: python -m vskipper.data.make_prompts rewrites the same files."""
from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mia", "Noor",
         "Omar", "Pia", "Quinn", "Ravi", "Sara", "Tom"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "shells", "cards", "stamps"]


def word_problem(r: random.Random) -> tuple[str, int]:
    n, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(3, 60), r.randint(2, 40), r.randint(2, 9)
    kind = r.randrange(6)
    if kind == 0:
        return f"{n} has {a} {item} and buys {b} more. How many {item} does {n} have now?", a + b
    if kind == 1:
        a = a + b
        return f"{n} had {a} {item} and gave {b} of them to a friend. How many {item} are left?", a - b
    if kind == 2:
        return f"{n} buys {c} boxes with {b} {item} in each box. How many {item} is that in total?", b * c
    if kind == 3:
        return f"{n} shares {b * c} {item} equally among {c} friends. How many {item} does each friend get?", b
    if kind == 4:
        p = r.randint(2, 12)
        return (f"A pencil costs {p} dollars. {n} buys {c} pencils and pays with a {p * c + b} dollar bill. "
                f"How much change does {n} get?"), b
    d = r.randint(2, 5)
    return (f"{n} reads {b} pages a day for {c} days, then {d} more pages on the last day. "
            f"How many pages did {n} read?"), b * c + d


def arithmetic(r: random.Random) -> tuple[str, int]:
    a, b, c = r.randint(2, 99), r.randint(2, 99), r.randint(2, 12)
    op = r.randrange(4)
    if op == 0:
        return f"What is {a} + {b}?", a + b
    if op == 1:
        return f"What is {a + b} - {b}?", a
    if op == 2:
        return f"What is {a} times {c}?", a * c
    return f"What is {a * c} divided by {c}?", a


def reasoning(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(5)
    if kind == 0:
        vals = [r.choice(["True", "False"]) for _ in range(3)]
        ops = [r.choice(["and", "or"]) for _ in range(2)]
        expr = f"{vals[0]} {ops[0]} {vals[1]} {ops[1]} {vals[2]}"
        return f"Evaluate the boolean expression: {expr}. Answer True or False.", str(eval(expr))
    if kind == 1:
        objs = r.sample(["a chair", "a table", "a lamp", "a bed", "a sofa", "a desk", "a shelf"], r.randint(2, 4))
        fruits = r.sample(["an apple", "a banana", "a pear", "a plum", "an orange"], r.randint(1, 3))
        return (f"I have {', '.join(objs + fruits)}. How many pieces of furniture do I have?"), str(len(objs))
    if kind == 2:
        a, b, c = r.sample(NAMES, 3)
        return (f"{a} is taller than {b}. {b} is taller than {c}. Who is the shortest?"), c
    if kind == 3:
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        i, k = r.randrange(7), r.randint(1, 6)
        return f"Today is {days[i]}. What day of the week will it be in {k} days?", days[(i + k) % 7]
    n = r.choice(NAMES)
    a, b = r.randint(2, 9), r.randint(2, 9)
    return (f"{n} walks {a} kilometers north, then {b} kilometers south. How far is {n} from the start, "
            f"in kilometers?"), str(abs(a - b))


def main() -> None:
    here = Path(__file__).parent
    r = random.Random(20261129)
    rows = []
    for i in range(240):
        q, a = word_problem(r)
        rows.append({"kind": "word_problem", "prompt": q + " Think step by step.", "answer": str(a)})
    for i in range(160):
        q, a = reasoning(r)
        rows.append({"kind": "reasoning", "prompt": q, "answer": a})
    r.shuffle(rows)
    with open(here / "prompts.jsonl", "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"p{i:03d}", **row}) + "\n")
    r = random.Random(7)
    with open(here / "arithmetic.jsonl", "w") as f:
        for i in range(500):  # the first 200 are the set of earlier releases
            q, a = arithmetic(r) if i % 2 else word_problem(r)
            f.write(json.dumps({"id": f"a{i:03d}", "kind": "arithmetic", "prompt": q, "answer": str(a)}) + "\n")


if __name__ == "__main__":
    main()
