"""The embedded dataset: short synthetic stories generated from a seed (no download, any size).

The stories follow simple rules (counting, giving, colours, places), so a small model's loss
falls visibly within a few hundred steps: the default run shows learning, not noise.
"""

from __future__ import annotations

import random

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar"]
THINGS = ["apples", "books", "coins", "pens", "cups", "stones", "shells", "cards", "keys", "maps"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
PLACES = ["the park", "the market", "the library", "the river", "the school", "the garden", "the station"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing, colour, place = rng.choice(THINGS), rng.choice(COLOURS), rng.choice(PLACES)
    have = rng.randint(1, 10)
    give = rng.randint(1, 10)
    kind = rng.randrange(3)
    if kind == 0:
        return (f"{a} has {NUMBERS[have]} {colour} {thing}. {b} gives {a} {NUMBERS[give]} more {thing}. "
                f"now {a} has {NUMBERS[have + give]} {colour} {thing}.")
    if kind == 1:
        take = rng.randint(0, have)
        return (f"{a} went to {place} with {NUMBERS[have]} {thing}. {a} left {NUMBERS[take]} {thing} at {place}. "
                f"{a} came home with {NUMBERS[have - take]} {thing}.")
    return (f"{a} likes {colour} {thing} and {b} likes {rng.choice(COLOURS)} {thing}. they meet at {place}. "
            f"{a} shows {b} the {colour} {thing}.")


def generate(num_docs: int, seed: int = 0) -> list[str]:
    """``num_docs`` stories, deterministic for a seed."""
    rng = random.Random(seed)
    return [" ".join(_story(rng) for _ in range(rng.randint(2, 5))) for _ in range(num_docs)]
