"""Prompts for self-distillation: benchmark-style prompt files, and prompts made without any evaluation set.

``read_turns`` reads the ``{"turns": [...]}`` rows the evaluation and training prompt files use. Two kinds of
prompts are made here, so a drafter sees the kinds of answers the evaluation sets ask for (arithmetic word problems
solved step by step, short functions, questions to an assistant) without seeing those sets:
``template_math_problems`` fills arithmetic word-problem templates with random names, objects and numbers, and
``self_written_prompts`` asks the target itself to write a task, a problem or a question on a random topic.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MATH_SUFFIXES = ("\nPlease reason step by step, and put your final answer within \\boxed{}.",
                 "\nSolve it step by step.", "\nShow your work and give the final answer.", "")
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe")
OBJECTS = ("apples", "books", "stickers", "marbles", "cookies", "pencils", "cards", "eggs", "flowers", "stamps",
           "toy cars", "cupcakes", "bottles", "shells", "coins", "candles", "notebooks", "oranges", "tickets", "bricks")
PLACES = ("the market", "school", "the bakery", "the library", "the park", "the store", "the farm", "a fair")
# {n}: a name, {o}: objects, {p}: a place, {a}..{e}: numbers
MATH_TEMPLATES = (
    "{n} has {a} {o}. {n} buys {b} more at {p} and then gives {c} to a friend. How many {o} does {n} have now?",
    "{n} sells {o} at {p} for ${d} each. On Monday {n} sells {a} and on Tuesday {b}. How much money does {n} make "
    "in total?",
    "A box holds {d} {o}. {n} fills {a} boxes and has {c} {o} left over. How many {o} did {n} have at the start?",
    "{n} reads {a} pages a day for {d} days, then {b} pages a day for {c} days. How many pages does {n} read?",
    "There are {a} {o} at {p}. {c} are sold in the morning and {b} more arrive in the afternoon. How many {o} are "
    "there at the end of the day?",
    "{n} earns ${a} a week and saves ${c} of it. After {d} weeks, {n} spends ${b} on a gift. How much has {n} "
    "saved?",
    "A bus carries {a} people. At the first stop {c} get off and {b} get on; at the second stop twice as many get "
    "on as got off at the first. How many people are on the bus now?",
    "{n} bakes {a} trays of {o} with {d} on each tray. {n} gives away {c} and eats {b}. How many are left?",
    "A garden has {a} rows of {o} with {d} in each row. {n} plants {b} more rows. How many {o} are in the garden?",
    "{n} runs {d} kilometres on each of {a} days and walks {b} kilometres on {c} other days. How far does {n} go?",
    "{n} buys {a} {o} for ${b} each and pays with a ${e} bill. How much change does {n} get?",
    "The price of a ticket to {p} is ${d}. A group of {a} adults and {b} children go; children pay half price. "
    "What does the group pay?",
)
CODE_TOPICS = ("strings", "lists", "dictionaries", "sorting", "prime numbers", "recursion", "matrices", "dates",
               "files", "sets", "tuples", "binary numbers", "searching", "stacks", "queues", "graphs", "geometry",
               "text parsing", "regular expressions", "classes", "number digits", "fibonacci numbers", "averages")
CHAT_TOPICS = ("travel", "cooking", "history", "science", "health", "careers", "music", "movies", "sports",
               "writing", "economics", "philosophy", "technology", "the environment", "education", "art", "pets",
               "gardening", "personal finance", "productivity", "languages", "space", "psychology", "law")
WRITE_INSTRUCTIONS = {
    "math": "Write a new math word problem for a school student about {topic}. Write only the problem.",
    "code": "Write a short Python programming exercise about {topic}, starting with 'Write a function'. Write only "
            "the exercise.",
    "chat": "Write one question or request that a user might send to an AI assistant about {topic}. Write only the "
            "question.",
}
TOPICS = {"math": OBJECTS + ("money", "time", "distance", "shopping", "cooking"),
          "code": CODE_TOPICS, "chat": CHAT_TOPICS}


def read_turns(path: str | Path) -> list[list[str]]:
    """The user turns of every row of a ``{"turns": ["first", "second", ...]}`` JSONL file."""
    rows = []
    path = Path(path)
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row.get("turns") if isinstance(row, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise ValueError(f"{path}:{number}: each row needs 'turns', a non-empty list of non-empty strings")
        rows.append(turns)
    return rows


def template_math_problems(count: int, seed: int) -> list[str]:
    """``count`` arithmetic word problems from ``MATH_TEMPLATES`` with random fillers and an answer suffix."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
        d, e = rng.randint(2, 12), rng.choice((50, 100, 200))
        text = rng.choice(MATH_TEMPLATES).format(n=rng.choice(NAMES), o=rng.choice(OBJECTS), p=rng.choice(PLACES),
                                                 a=a, b=b, c=c, d=d, e=e)
        problems.append(text + rng.choice(MATH_SUFFIXES))
    return problems


def write_requests(kind: str, count: int, seed: int) -> list[str]:
    """``count`` instructions asking the target to write a prompt of ``kind`` (math, code, chat) on random topics."""
    rng = random.Random(seed)
    return [WRITE_INSTRUCTIONS[kind].format(topic=rng.choice(TOPICS[kind])) for _ in range(count)]


def usable_prompt(text: str, max_chars: int = 1500) -> str | None:
    """A written prompt stripped of quotes and labels, or None when it is empty or too long."""
    text = text.strip().strip('"').strip()
    for label in ("Problem:", "Question:", "Exercise:", "Task:"):
        if text.startswith(label):
            text = text[len(label):].strip()
    return text if 10 <= len(text) <= max_chars else None
