"""A synthetic English-like -> French-like parallel corpus with real structure.

The corpus is the default data set of the demo and of the test fixtures: small enough
that a tiny transformer learns its frequent patterns on a CPU in minutes, but with the
phenomena that make translation a sequence-to-sequence problem rather than a word
substitution.

Lexicon
    Open-class words are pronounceable pseudo-words built from syllables. Each lemma
    has a source form and its own target form (a word-for-word lexical mapping).
    Nouns, adjectives, transitive and intransitive verbs are generated from a fixed
    seed (``LEXICON_SEED``), so every corpus seed speaks the same language; adverbs
    are derived from the first adjectives (source ``-ly``, target ``-ement``).
    Closed-class words (determiners, pronouns, prepositions, conjunctions, auxiliaries)
    are real English and French words. Every surface form of a generated word is
    unique across classes and languages. Lemmas are drawn with a Zipf distribution
    (weight ``1 / rank``), so a few words are very frequent and the tail is rare.

Morphology
    source: plural nouns ``+s``; verbs ``+s`` in the 3rd person singular present,
    ``+ed`` in the past; adjectives do not inflect.
    target: nouns have a lexical gender and take ``+s`` in the plural; determiners
    agree in gender and number (le/la/les, un/une/des, ce/cette/ces, mon/ma/mes);
    adjectives take ``+e`` (feminine) and ``+s`` (plural); present verbs agree with
    the subject (je -e, tu -es, il/elle -e, nous -ons, ils -ent); the past is an
    auxiliary that agrees (ai, as, a, avons, ont) plus a participle ``+é``;
    the copula is suis/es/est/sommes/sont (past étais/était/étions/étaient).
    ``de`` and ``à`` contract with ``le``/``les`` (du, des, au, aux).

Syntax (source -> target)
    noun phrase   DET ADJ* NOUN [PP] [that CLAUSE]  ->  DET NOUN ADJ* (mirrored) [PP]
                  [qui|que CLAUSE]; ``qui`` when the relative clause lacks its subject,
                  ``que`` when it lacks its object; the gap agrees with the head noun.
    clause        SUBJ [ADV] VERB [OBJ] [PP]  ->  SUBJ VERB [ADV] [OBJ] [PP]
                  past: SUBJ [ADV] VERBed  ->  SUBJ AUX [ADV] PARTICIPLE
                  negation: SUBJ do/does/did not [ADV] VERB  ->  SUBJ ne VERB pas [ADV]
                  copula: SUBJ is [not] [ADV] ADJ  ->  SUBJ [ne] est [pas] [ADV] ADJ
    subordinate   because/when/if/although CLAUSE -> puisque/lorsque/si/quoique CLAUSE
                  with the target verb last: SUBJ [ADV] [OBJ] [PP] [ne pas] VERB
                  (past: PARTICIPLE AUX; copula: ADJ [ne pas] COPULA); a subordinate
                  clause may come first, followed by a comma.
    coordination  and/but/or CLAUSE -> et/mais/ou CLAUSE (main-clause order).

Recursion (prepositional phrases, relative clauses, attached clauses) is bounded by
``max_depth``: the mean source length is about 6 tokens at 0, 11 at 1 and 13.5 at the
default 2; beyond 3 the length cap dominates. Every sentence ends with " ." and has
3..40 tokens on both sides (sentences outside that range are drawn again). Output is
lower-cased UTF-8, one sentence per line, tokens separated by single spaces.

Usage: ``python -m fastgen_demo.synthetic OUT_DIR [--train N] [--valid N]
[--test N] [--seed S] [--max-depth D]``.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import os
import random
from dataclasses import dataclass
from typing import Optional, Union

LEXICON_SEED = 1729
NOUN_COUNT = 320
ADJECTIVE_COUNT = 160
ADVERB_COUNT = 60
TRANSITIVE_VERB_COUNT = 90
INTRANSITIVE_VERB_COUNT = 40
ZIPF_EXPONENT = 1.0

MIN_TOKENS = 3
MAX_TOKENS = 40
DEFAULT_MAX_DEPTH = 2
DEFAULT_SIZES = {"train": 20000, "valid": 500, "test": 500}


# ---------------------------------------------------------------------------
# closed-class words

@dataclass(frozen=True)
class Determiner:
    source_singular: Optional[str]  # None: the determiner only exists in the plural
    source_plural: str
    target_masculine: Optional[str]
    target_feminine: Optional[str]
    target_plural: str

    def source(self, plural: bool) -> str:
        return self.source_plural if plural else self.source_singular

    def target(self, feminine: bool, plural: bool) -> str:
        if plural:
            return self.target_plural
        return self.target_feminine if feminine else self.target_masculine


@dataclass(frozen=True)
class Word:
    """A lemma with one source and one target form (prepositions, adverbs, ...)."""

    source: str
    target: str


@dataclass(frozen=True)
class Pronoun(Word):
    person: int
    plural: bool
    feminine: bool


@dataclass(frozen=True)
class Connective(Word):
    subordinating: bool  # subordinate clauses put the target verb last


DETERMINERS = (
    Determiner("the", "the", "le", "la", "les"),
    Determiner("a", "some", "un", "une", "des"),
    Determiner("this", "these", "ce", "cette", "ces"),
    Determiner("my", "my", "mon", "ma", "mes"),
    Determiner(None, "two", None, None, "deux"),
    Determiner(None, "three", None, None, "trois"),
)
DETERMINER_WEIGHTS = (45, 25, 10, 10, 5, 5)

PRONOUNS = (
    Pronoun("i", "je", 1, False, False),
    Pronoun("you", "tu", 2, False, False),
    Pronoun("he", "il", 3, False, False),
    Pronoun("she", "elle", 3, False, True),
    Pronoun("we", "nous", 1, True, False),
    Pronoun("they", "ils", 3, True, False),
)

PREPOSITIONS = (
    Word("of", "de"), Word("in", "dans"), Word("on", "sur"), Word("with", "avec"),
    Word("to", "à"), Word("for", "pour"), Word("under", "sous"),
    Word("without", "sans"), Word("near", "près"),
)
PREPOSITION_WEIGHTS = (25, 20, 15, 15, 10, 5, 4, 3, 3)
CONTRACTIONS = {("de", "le"): "du", ("de", "les"): "des", ("à", "le"): "au", ("à", "les"): "aux"}

SUBORDINATORS = (
    Connective("because", "puisque", True), Connective("when", "lorsque", True),
    Connective("if", "si", True), Connective("although", "quoique", True),
)
COORDINATORS = (Connective("and", "et", False), Connective("but", "mais", False),
                Connective("or", "ou", False))

RELATIVIZER = "that"
TARGET_SUBJECT_RELATIVIZER, TARGET_OBJECT_RELATIVIZER = "qui", "que"
SOURCE_NEGATION = "not"
SOURCE_DID = "did"
TARGET_NEGATION = ("ne", "pas")

# agreement tables keyed by (person, plural)
SOURCE_DO = {(1, False): "do", (2, False): "do", (3, False): "does", (1, True): "do", (3, True): "do"}
SOURCE_BE = {(1, False): "am", (2, False): "are", (3, False): "is", (1, True): "are", (3, True): "are"}
SOURCE_WAS = {(1, False): "was", (2, False): "were", (3, False): "was", (1, True): "were", (3, True): "were"}
TARGET_VERB_ENDINGS = {(1, False): "e", (2, False): "es", (3, False): "e", (1, True): "ons", (3, True): "ent"}
TARGET_AUXILIARY = {(1, False): "ai", (2, False): "as", (3, False): "a", (1, True): "avons", (3, True): "ont"}
TARGET_BE = {(1, False): "suis", (2, False): "es", (3, False): "est", (1, True): "sommes", (3, True): "sont"}
TARGET_WAS = {(1, False): "étais", (2, False): "étais", (3, False): "était", (1, True): "étions",
              (3, True): "étaient"}
TARGET_PARTICIPLE_ENDING = "é"

CLOSED_CLASS_WORDS = frozenset(
    [w for d in DETERMINERS for w in (d.source_singular, d.source_plural, d.target_masculine,
                                      d.target_feminine, d.target_plural) if w]
    + [w for p in PRONOUNS for w in (p.source, p.target)]
    + [w for c in PREPOSITIONS + SUBORDINATORS + COORDINATORS for w in (c.source, c.target)]
    + list(CONTRACTIONS.values())
    + [RELATIVIZER, TARGET_SUBJECT_RELATIVIZER, TARGET_OBJECT_RELATIVIZER, SOURCE_NEGATION,
       *TARGET_NEGATION, ".", ","]
    + [w for table in (SOURCE_DO, SOURCE_BE, SOURCE_WAS, TARGET_AUXILIARY, TARGET_BE, TARGET_WAS)
       for w in table.values()]
    + [SOURCE_DID]
)


# ---------------------------------------------------------------------------
# open-class lexicon

@dataclass(frozen=True)
class Noun(Word):
    feminine: bool


@dataclass(frozen=True)
class Adjective(Word):
    """Target forms: stem, stem+e (feminine), stem+s (plural), stem+es."""


@dataclass(frozen=True)
class Verb(Word):
    transitive: bool


@dataclass(frozen=True)
class Lexicon:
    """Lemmas of each class in Zipf rank order (the first is the most frequent)."""

    nouns: tuple
    adjectives: tuple
    adverbs: tuple  # Word(source "...ly", target "...ement"), derived from adjectives
    transitive_verbs: tuple
    intransitive_verbs: tuple


@dataclass(frozen=True)
class Phonology:
    onsets: tuple
    vowels: tuple
    codas: tuple  # word-final consonants; none is "s" or "e", so suffixes stay unambiguous


SOURCE_SOUNDS = Phonology(
    onsets=tuple("b bl br c cl cr d dr f fl fr g gl gr h j k l m n p pl pr r s sh sk sl sn "
                 "sp st str t th tr v w wh z".split()),
    vowels=tuple("a e i o u ai ea ee oa oo".split()),
    codas=tuple("ck d ft g k l ll m mp n nd nk nt p r rk rn sh t th".split()),
)
TARGET_SOUNDS = Phonology(
    onsets=tuple("b bl br ch d f fl fr g gr j l m n p pl pr qu r t tr v".split()),
    vowels=tuple("a e i o u ai au eu ou oi".split()),
    codas=tuple("c d l m n r rd rt t".split()),
)


def source_forms(stem: str, word_class: type) -> list:
    """Every source surface form of a generated stem (see the module docstring)."""
    if word_class is Noun:
        return [stem, stem + "s"]
    if word_class is Verb:
        return [stem, stem + "s", stem + "ed"]
    return [stem, stem + "ly"]  # adjective and the adverb derived from it


def target_forms(stem: str, word_class: type) -> list:
    if word_class is Noun:
        return [stem, stem + "s"]
    if word_class is Verb:
        return [stem + ending for ending in TARGET_VERB_ENDINGS.values()] + [stem + TARGET_PARTICIPLE_ENDING]
    return [stem, stem + "e", stem + "s", stem + "es", stem + "ement"]


def _pseudo_word(rng: random.Random, sounds: Phonology, final_consonant: bool) -> str:
    syllables = rng.choice((1, 1, 2, 2, 2, 3))
    word = "".join(rng.choice(sounds.onsets) + rng.choice(sounds.vowels) for _ in range(syllables))
    return word + rng.choice(sounds.codas) if final_consonant else word


def _fresh_stem(rng, sounds, forms_of, taken: set, final_consonant=True) -> str:
    """Draw stems until none of their surface forms is already in use, then claim them."""
    while True:
        stem = _pseudo_word(rng, sounds, final_consonant)
        forms = forms_of(stem)
        if len(stem) >= 3 and not taken.intersection(forms):
            taken.update(forms)
            return stem


@functools.lru_cache(maxsize=None)
def build_lexicon() -> Lexicon:
    """The fixed lexicon, identical for every corpus seed."""
    rng = random.Random(LEXICON_SEED)
    taken = set(CLOSED_CLASS_WORDS)

    def pair(word_class, target_final_consonant=True):
        source = _fresh_stem(rng, SOURCE_SOUNDS, lambda s: source_forms(s, word_class), taken)
        target = _fresh_stem(rng, TARGET_SOUNDS, lambda s: target_forms(s, word_class), taken,
                             final_consonant=target_final_consonant)
        return source, target

    nouns = tuple(Noun(*pair(Noun, rng.random() < 0.5), feminine=rng.random() < 0.5)
                  for _ in range(NOUN_COUNT))
    adjectives = tuple(Adjective(*pair(Adjective)) for _ in range(ADJECTIVE_COUNT))
    adverbs = tuple(Word(a.source + "ly", a.target + "ement") for a in adjectives[:ADVERB_COUNT])
    transitive = tuple(Verb(*pair(Verb), transitive=True) for _ in range(TRANSITIVE_VERB_COUNT))
    intransitive = tuple(Verb(*pair(Verb), transitive=False) for _ in range(INTRANSITIVE_VERB_COUNT))
    return Lexicon(nouns, adjectives, adverbs, transitive, intransitive)


class ZipfSampler:
    """Draws items with probability proportional to ``1 / rank ** exponent``."""

    def __init__(self, items, exponent: float = ZIPF_EXPONENT):
        self.items = tuple(items)
        self.cumulative = list(itertools.accumulate(1.0 / (rank ** exponent)
                                                    for rank in range(1, len(self.items) + 1)))

    def __call__(self, rng: random.Random):
        point = rng.random() * self.cumulative[-1]
        return self.items[min(bisect.bisect_right(self.cumulative, point), len(self.items) - 1)]


@functools.lru_cache(maxsize=None)
def _samplers() -> dict:
    lexicon = build_lexicon()
    return {name: ZipfSampler(getattr(lexicon, name)) for name in
            ("nouns", "adjectives", "adverbs", "transitive_verbs", "intransitive_verbs")}


# ---------------------------------------------------------------------------
# syntax trees

@dataclass
class PrepPhrase:
    preposition: Word
    object: "NounPhrase"


@dataclass
class NounPhrase:
    noun: Noun
    determiner: Determiner = DETERMINERS[0]
    plural: bool = False
    adjectives: tuple = ()
    modifier: Optional[PrepPhrase] = None
    relative: Optional["Clause"] = None  # a clause with a subject or object gap


@dataclass
class Clause:
    """A clause; ``verb=None`` makes it copular with the adjective ``predicate``.

    In a relative clause ``subject=None`` marks a subject gap, and ``object=None`` with a
    transitive verb an object gap.
    """

    subject: Union[NounPhrase, Pronoun, None]
    verb: Optional[Verb] = None
    object: Optional[NounPhrase] = None
    predicate: Optional[Adjective] = None
    adverb: Optional[Word] = None
    past: bool = False
    negated: bool = False
    place: Optional[PrepPhrase] = None
    attachment: Optional["Attachment"] = None


@dataclass
class Attachment:
    connective: Connective
    clause: Clause
    fronted: bool = False  # subordinate clause first, followed by a comma


@dataclass(frozen=True)
class Agreement:
    person: int
    plural: bool
    feminine: bool

    @property
    def key(self):
        return (self.person, self.plural)


# ---------------------------------------------------------------------------
# rendering (tree -> source tokens, target tokens)

def _target_adjective(adjective: Adjective, agreement: Agreement) -> str:
    return adjective.target + ("e" if agreement.feminine else "") + ("s" if agreement.plural else "")


def _render_noun_phrase(phrase: NounPhrase):
    plural, feminine = phrase.plural, phrase.noun.feminine
    agreement = Agreement(3, plural, feminine)
    suffix = "s" if plural else ""
    source = [phrase.determiner.source(plural), *(a.source for a in phrase.adjectives),
              phrase.noun.source + suffix]
    target = [phrase.determiner.target(feminine, plural), phrase.noun.target + suffix,
              *(_target_adjective(a, agreement) for a in reversed(phrase.adjectives))]
    if phrase.modifier:
        _extend(source, target, _render_prep_phrase(phrase.modifier))
    if phrase.relative:
        relativizer = (TARGET_SUBJECT_RELATIVIZER if phrase.relative.subject is None
                       else TARGET_OBJECT_RELATIVIZER)
        _extend(source, target, ([RELATIVIZER], [relativizer]))
        _extend(source, target, _render_clause(phrase.relative, gap=agreement))
    return source, target


def _render_prep_phrase(phrase: PrepPhrase):
    object_source, object_target = _render_noun_phrase(phrase.object)
    contracted = CONTRACTIONS.get((phrase.preposition.target, object_target[0]))
    target_head = [contracted] if contracted else [phrase.preposition.target, object_target[0]]
    return [phrase.preposition.source] + object_source, target_head + object_target[1:]


def _extend(source: list, target: list, rendered) -> None:
    source.extend(rendered[0])
    target.extend(rendered[1])


def _render_subject(subject, gap: Optional[Agreement]):
    if subject is None:
        return [], [], gap
    if isinstance(subject, Pronoun):
        return [subject.source], [subject.target], Agreement(subject.person, subject.plural, subject.feminine)
    source, target = _render_noun_phrase(subject)
    return source, target, Agreement(3, subject.plural, subject.noun.feminine)


def _render_verb_group(clause: Clause, agreement: Agreement, verb_final: bool):
    """Source and target tokens of the verb, negation, adverb and copular predicate.

    In a verb-final clause the target adverb is left out: the clause puts it first.
    """
    key = agreement.key
    adverb_source = [clause.adverb.source] if clause.adverb else []
    adverb_target = [clause.adverb.target] if clause.adverb and not verb_final else []
    negation = [SOURCE_NEGATION] if clause.negated else []
    if clause.verb is None:
        source = [(SOURCE_WAS if clause.past else SOURCE_BE)[key], *negation, *adverb_source,
                  clause.predicate.source]
        finite = (TARGET_WAS if clause.past else TARGET_BE)[key]
        complement = [_target_adjective(clause.predicate, agreement)]
    else:
        stem = clause.verb.source
        if clause.negated:
            source = [SOURCE_DID if clause.past else SOURCE_DO[key], *negation, *adverb_source, stem]
        else:
            source = [*adverb_source, stem + "ed" if clause.past else stem + ("s" if key == (3, False) else "")]
        if clause.past:
            finite = TARGET_AUXILIARY[key]
            complement = [clause.verb.target + TARGET_PARTICIPLE_ENDING]
        else:
            finite, complement = clause.verb.target + TARGET_VERB_ENDINGS[key], []
    if not verb_final:
        ne, pas = ([TARGET_NEGATION[0]], [TARGET_NEGATION[1]]) if clause.negated else ([], [])
        return source, [*ne, finite, *pas, *adverb_target, *complement]
    negation_target = list(TARGET_NEGATION) if clause.negated else []
    if clause.verb is None:  # puisque il grand ne pas est
        return source, [*complement, *negation_target, finite]
    return source, [*negation_target, *complement, finite]  # puisque il ne pas mangé a


def _render_clause(clause: Clause, verb_final: bool = False, gap: Optional[Agreement] = None):
    source, target, agreement = _render_subject(clause.subject, gap)
    verb_source, verb_target = _render_verb_group(clause, agreement, verb_final)
    object_source, object_target = _render_noun_phrase(clause.object) if clause.object else ([], [])
    place_source, place_target = _render_prep_phrase(clause.place) if clause.place else ([], [])
    source += verb_source + object_source + place_source
    if verb_final:
        adverb = [clause.adverb.target] if clause.adverb else []
        target += adverb + object_target + place_target + verb_target
    else:
        target += verb_target + object_target + place_target
    if clause.attachment:
        attached = clause.attachment
        sub_source, sub_target = _render_clause(attached.clause, verb_final=attached.connective.subordinating)
        sub_source = [attached.connective.source] + sub_source
        sub_target = [attached.connective.target] + sub_target
        if attached.fronted:
            return sub_source + [","] + source, sub_target + [","] + target
        source, target = source + sub_source, target + sub_target
    return source, target


def render_sentence(clause: Clause) -> tuple:
    """The (source, target) sentence strings of a top-level clause, with final " ."."""
    source, target = _render_clause(clause)
    return " ".join(source + ["."]), " ".join(target + ["."])


# ---------------------------------------------------------------------------
# sampling

def sample_noun_phrase(rng: random.Random, depth: int, max_depth: int) -> NounPhrase:
    samplers = _samplers()
    determiner = rng.choices(DETERMINERS, weights=DETERMINER_WEIGHTS)[0]
    plural = determiner.source_singular is None or rng.random() < 0.3
    adjective_count = rng.choices((0, 1, 2), weights=(55, 35, 10))[0]
    adjectives = tuple(samplers["adjectives"](rng) for _ in range(adjective_count))
    phrase = NounPhrase(samplers["nouns"](rng), determiner, plural, adjectives)
    if depth < max_depth:
        roll = rng.random()
        if roll < 0.22:
            phrase.modifier = sample_prep_phrase(rng, depth + 1, max_depth)
        elif roll < 0.35:
            gap = "subject" if rng.random() < 0.6 else "object"
            phrase.relative = sample_clause(rng, depth + 1, max_depth, gap=gap)
    return phrase


def sample_prep_phrase(rng: random.Random, depth: int, max_depth: int) -> PrepPhrase:
    preposition = rng.choices(PREPOSITIONS, weights=PREPOSITION_WEIGHTS)[0]
    return PrepPhrase(preposition, sample_noun_phrase(rng, depth, max_depth))


def sample_clause(rng: random.Random, depth: int, max_depth: int, gap: Optional[str] = None) -> Clause:
    """A clause at ``depth``; ``gap`` ("subject"/"object") makes it a relative clause."""
    samplers = _samplers()
    if gap == "subject":
        subject = None
    elif rng.random() < 0.3:
        subject = rng.choice(PRONOUNS)
    else:
        subject = sample_noun_phrase(rng, depth, max_depth)
    clause = Clause(subject, past=rng.random() < 0.4, negated=rng.random() < 0.12)
    kind = rng.random()
    if gap != "object" and kind < 0.15:
        clause.predicate = samplers["adjectives"](rng)
    elif gap != "object" and kind < 0.4:
        clause.verb = samplers["intransitive_verbs"](rng)
    else:
        clause.verb = samplers["transitive_verbs"](rng)
        if gap != "object":
            clause.object = sample_noun_phrase(rng, depth, max_depth)
    if rng.random() < 0.2:
        clause.adverb = samplers["adverbs"](rng)
    if clause.verb is not None and depth < max_depth and rng.random() < 0.25:
        clause.place = sample_prep_phrase(rng, depth + 1, max_depth)
    if gap is None and depth < max_depth and rng.random() < 0.35:
        if rng.random() < 0.6:
            clause.attachment = Attachment(rng.choice(SUBORDINATORS), sample_clause(rng, depth + 1, max_depth),
                                           fronted=depth == 0 and rng.random() < 0.25)
        else:
            clause.attachment = Attachment(rng.choice(COORDINATORS), sample_clause(rng, depth + 1, max_depth))
    return clause


def make_sentence_pair(rng: random.Random, max_depth: int = DEFAULT_MAX_DEPTH) -> tuple:
    """One (source, target) sentence pair with MIN_TOKENS..MAX_TOKENS tokens on both sides."""
    while True:
        source, target = render_sentence(sample_clause(rng, 0, max_depth))
        if all(MIN_TOKENS <= line.count(" ") + 1 <= MAX_TOKENS for line in (source, target)):
            return source, target


# ---------------------------------------------------------------------------
# corpus files

def generate_corpus(out_dir, n_train: int = DEFAULT_SIZES["train"], n_valid: int = DEFAULT_SIZES["valid"],
                    n_test: int = DEFAULT_SIZES["test"], seed: int = 1, src: str = "en", tgt: str = "fr",
                    max_depth: int = DEFAULT_MAX_DEPTH) -> dict:
    """Write ``{train,valid,test}.{src,tgt}`` under ``out_dir``.

    Each split has its own generator, ``random.Random(f"{seed}:{split}")``, so the test
    split does not change when the training size does. Returns the file paths, the
    sentence counts and per-language statistics: ``vocabulary`` (distinct tokens of the
    train split) and min/mean/max sentence length in tokens over all splits.
    """
    os.makedirs(out_dir, exist_ok=True)
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    paths, lengths = {}, {src: [], tgt: []}
    train_vocabulary = {src: set(), tgt: set()}
    for split, size in sizes.items():
        rng = random.Random(f"{seed}:{split}")
        pairs = [make_sentence_pair(rng, max_depth) for _ in range(size)]
        for side, lang in enumerate((src, tgt)):
            lines = [pair[side] for pair in pairs]
            path = os.path.join(out_dir, f"{split}.{lang}")
            with open(path, "w", encoding="utf-8", newline="\n") as handle:
                handle.write("".join(line + "\n" for line in lines))
            paths[f"{split}.{lang}"] = path
            for line in lines:
                tokens = line.split(" ")
                lengths[lang].append(len(tokens))
                if split == "train":
                    train_vocabulary[lang].update(tokens)
    stats = {lang: {"vocabulary": len(train_vocabulary[lang]),
                    "min_length": min(lengths[lang], default=0),
                    "mean_length": sum(lengths[lang]) / max(len(lengths[lang]), 1),
                    "max_length": max(lengths[lang], default=0)}
             for lang in (src, tgt)}
    return {"out_dir": str(out_dir), "paths": paths, "counts": sizes, "stats": stats}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=DEFAULT_SIZES["train"])
    parser.add_argument("--valid", type=int, default=DEFAULT_SIZES["valid"])
    parser.add_argument("--test", type=int, default=DEFAULT_SIZES["test"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH,
                        help="recursion depth of phrases and clauses (difficulty)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="fr")
    args = parser.parse_args(argv)
    result = generate_corpus(args.out_dir, args.train, args.valid, args.test, seed=args.seed,
                             src=args.src, tgt=args.tgt, max_depth=args.max_depth)
    counts = ", ".join(f"{split} {count}" for split, count in result["counts"].items())
    print(f"wrote {result['out_dir']}: {counts} sentence pairs (seed {args.seed}, max depth {args.max_depth})")
    for lang, stats in result["stats"].items():
        print(f"{lang}: vocabulary {stats['vocabulary']} (train); length min {stats['min_length']} "
              f"/ mean {stats['mean_length']:.1f} / max {stats['max_length']} tokens")
    return result


if __name__ == "__main__":
    main()
