"""``--dataset synthetic``: short documents from a seeded word-level Markov grammar (cheap, deterministic and
learnable: the smoke-test corpus).

The grammar (``num_words`` lowercase words, each followed by one of three successors with probabilities
0.6/0.3/0.1, or by the end of the sentence) depends on the seed only; train and eval documents are different
walks of it. A document is a few capitalised sentences ending with ``"."``.
"""

from __future__ import annotations

import string
from collections.abc import Iterator

import numpy as np

from nash_mhc.data.sources.base import Corpus


def grammar(seed: int, num_words: int = 48) -> tuple[list[str], np.ndarray]:
    """(words, successors): ``successors[w]`` holds 3 next-word ids; id ``num_words`` ends the sentence."""
    rng = np.random.default_rng([seed, 0x5EED])
    words: list[str] = []
    while len(words) < num_words:
        word = "".join(string.ascii_lowercase[i] for i in rng.integers(0, 26, size=int(rng.integers(2, 8))))
        if word not in words:
            words.append(word)
    return words, rng.integers(0, num_words + 1, size=(num_words, 3))


def corpus(part: str, seed: int = 0, num_documents: int | None = None) -> Corpus:
    """``num_documents`` documents (default: 1000 train, 64 eval) of the grammar of ``seed``."""
    count = num_documents or (1000 if part == "train" else 64)

    def documents() -> Iterator[str]:
        words, successors = grammar(seed)
        end = len(words)
        rng = np.random.default_rng([seed, 0xD0C, int(part == "eval")])
        for _ in range(count):
            sentences = []
            for _ in range(int(rng.integers(2, 6))):
                w = int(rng.integers(0, min(8, end)))
                out = [words[w]]
                while len(out) < 16:
                    u = rng.random()
                    w = int(successors[w, 0 if u < 0.6 else (1 if u < 0.9 else 2)])
                    if w == end:
                        break
                    out.append(words[w])
                sentences.append(" ".join(out).capitalize() + ".")
            yield " ".join(sentences)

    return Corpus("synthetic", part, documents)
