"""A multi-parallel synthetic corpus: two source languages into one target.

The first source and the target are :mod:`fastgen_demo.synthetic`'s
English-like -> French-like corpus (same seed, same sentences); the second
source language is the first re-spelled word by word (:func:`second_source_sentence`),
so line i of every file is the same sentence, as in Multi30k.  The toy
multilingual model of the tests (``fastgen_demo.toy``) is trained on it.

Kept apart from ``synthetic.py`` on purpose: the bilingual toy model's cache
key hashes that file, and every change to it retrains that model.
"""

import functools
import os
import random

from fastgen_demo.synthetic import DEFAULT_MAX_DEPTH, DEFAULT_SIZES, generate_corpus

SECOND_SOURCE_SEED = 2718


@functools.lru_cache(maxsize=None)
def _second_source_letters() -> dict:
    """A fixed permutation of the letters, vowels among vowels and consonants among consonants."""
    rng = random.Random(SECOND_SOURCE_SEED)
    mapping = {}
    for letters in ("aeiou", "bcdfghjklmnpqrstvwxyz"):
        shuffled = list(letters)
        rng.shuffle(shuffled)
        mapping.update(zip(letters, shuffled))
    return mapping


def second_source_sentence(source: str) -> str:
    """The English-like ``source`` in the second source language: every word re-spelled with a
    fixed letter permutation, and a final ``s`` of a word longer than two letters (plural nouns,
    3rd person verbs, ...) spelled ``en``: a fixed map of words, so the syntax stays the source's."""
    letters = _second_source_letters()
    words = []
    for word in source.split(" "):
        stem, ending = (word[:-1], "en") if len(word) > 2 and word.endswith("s") else (word, "")
        words.append("".join(letters.get(c, c) for c in stem) + ending)
    return " ".join(words)


def generate_multi_source_corpus(out_dir, n_train: int = DEFAULT_SIZES["train"],
                                 n_valid: int = DEFAULT_SIZES["valid"], n_test: int = DEFAULT_SIZES["test"],
                                 seed: int = 1, sources=("en", "de"), tgt: str = "fr",
                                 max_depth: int = DEFAULT_MAX_DEPTH) -> dict:
    """Write ``{train,valid,test}.{lang}`` for both ``sources`` and ``tgt`` under ``out_dir``.

    Returns :func:`~fastgen_demo.synthetic.generate_corpus`'s result (first source and
    target) with the second source's paths added."""
    first, second = sources
    result = generate_corpus(out_dir, n_train, n_valid, n_test, seed=seed, src=first, tgt=tgt, max_depth=max_depth)
    for split in result["counts"]:
        with open(result["paths"][f"{split}.{first}"], encoding="utf-8") as handle:
            lines = [second_source_sentence(line.rstrip("\n")) for line in handle]
        path = os.path.join(out_dir, f"{split}.{second}")
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write("".join(line + "\n" for line in lines))
        result["paths"][f"{split}.{second}"] = path
    return result
