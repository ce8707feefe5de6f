"""Writes ``examples/sft/tasks.jsonl``: 2000 small prompt/response records (reverse a word, upper-case it, add two
numbers) for the fine-tuning example of the README (``--prompt-field prompt --response-field response``).

    python examples/sft/make_tasks.py        # deterministic: the committed file is its output
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "maple", "quiet", "lemon", "north", "spark", "honey",
         "glass", "ocean", "pearl", "ruby", "delta", "amber", "cedar", "frost", "olive", "raven", "sunny", "tulip"]


def record(rng: random.Random) -> dict[str, str]:
    task = rng.choice(["reverse", "upper", "add"])
    if task == "add":
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return {"prompt": f"Task: add the two numbers.\nInput: {a} + {b}\nAnswer: ", "response": str(a + b)}
    word = rng.choice(WORDS)
    if task == "reverse":
        return {"prompt": f"Task: write the word backwards.\nInput: {word}\nAnswer: ", "response": word[::-1]}
    return {"prompt": f"Task: write the word in capitals.\nInput: {word}\nAnswer: ", "response": word.upper()}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(record(rng)) + "\n" for _ in range(2000)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
