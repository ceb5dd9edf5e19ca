"""Tests of the synthetic parallel corpus.

The expected target forms are written out here from the grammar's specification
(determiner table, suffixes, word order); the generator's own inflection code is never
called to produce an expectation. Corpus-level checks read the written files back.
"""

import collections
import os
import random
import subprocess
import sys
import time

import pytest

from fastgen_demo import synthetic

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEXICON = synthetic.build_lexicon()

# (feminine, plural) -> expected target form, from the specification
DEFINITE_ARTICLE = {(False, False): "le", (True, False): "la", (False, True): "les", (True, True): "les"}
ADJECTIVE_SUFFIX = {(False, False): "", (True, False): "e", (False, True): "s", (True, True): "es"}
# target determiner -> (feminine or None when it does not show gender, plural)
TARGET_DETERMINER_FEATURES = {
    "le": (False, False), "la": (True, False), "les": (None, True),
    "un": (False, False), "une": (True, False), "des": (None, True),
    "ce": (False, False), "cette": (True, False), "ces": (None, True),
    "mon": (False, False), "ma": (True, False), "mes": (None, True),
    "deux": (None, True), "trois": (None, True),
    "du": (False, False), "au": (False, False), "aux": (None, True),
}
# subject pronoun -> expected present ending, past auxiliary, copula
PRONOUN_AGREEMENT = {
    "je": ("e", "ai", "suis"), "tu": ("es", "as", "es"), "il": ("e", "a", "est"),
    "elle": ("e", "a", "est"), "nous": ("ons", "avons", "sommes"), "ils": ("ent", "ont", "sont"),
}
TARGET_COPULAS = {"suis", "es", "est", "sommes", "sont", "étais", "était", "étions", "étaient"}
SOURCE_PLURAL_DETERMINERS = {"some", "these", "two", "three"}
SOURCE_SINGULAR_DETERMINERS = {"a", "this"}


def read_lines(path):
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    assert text.endswith("\n")
    return text[:-1].split("\n")


def by_source(items, source):
    return next(item for item in items if getattr(item, "source", None) == source
                or getattr(item, "source_singular", None) == source)


def noun_with(feminine, index=0):
    return [noun for noun in LEXICON.nouns if noun.feminine == feminine][index]


def target_noun_features():
    """Target noun surface form -> (lemma, feminine, plural), using the spec's plural '+s'."""
    features = {}
    for noun in LEXICON.nouns:
        features[noun.target] = (noun, noun.feminine, False)
        features[noun.target + "s"] = (noun, noun.feminine, True)
    assert len(features) == 2 * len(LEXICON.nouns), "noun forms must be unambiguous"
    return features


def target_adjective_features():
    features = {}
    for adjective in LEXICON.adjectives:
        for (feminine, plural), suffix in ADJECTIVE_SUFFIX.items():
            features[adjective.target + suffix] = (adjective, feminine, plural)
    assert len(features) == 4 * len(LEXICON.adjectives), "adjective forms must be unambiguous"
    return features


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("default_corpus")
    started = time.perf_counter()
    result = synthetic.generate_corpus(str(out_dir), seed=1)
    elapsed = time.perf_counter() - started
    pairs = {split: list(zip(read_lines(os.path.join(out_dir, f"{split}.en")),
                             read_lines(os.path.join(out_dir, f"{split}.fr"))))
             for split in ("train", "valid", "test")}
    return {"dir": out_dir, "result": result, "elapsed": elapsed, "pairs": pairs}


def all_pairs(corpus):
    return [pair for pairs in corpus["pairs"].values() for pair in pairs]


# ---------------------------------------------------------------------------
# files, format, sizes

def test_default_sizes_files_and_speed(default_corpus):
    result = default_corpus["result"]
    assert result["counts"] == {"train": 20000, "valid": 500, "test": 500}
    for split, count in result["counts"].items():
        assert len(default_corpus["pairs"][split]) == count
        for lang in ("en", "fr"):
            path = result["paths"][f"{split}.{lang}"]
            assert os.path.dirname(path) == str(default_corpus["dir"])
            assert len(read_lines(path)) == count
    assert default_corpus["elapsed"] < 10.0


def test_lines_are_tokenized_lowercase_and_within_length(default_corpus):
    for pair in all_pairs(default_corpus):
        for line in pair:
            assert line and line == line.strip() and "  " not in line
            assert line == line.lower()
            assert line.endswith(" .")
            tokens = line.split(" ")
            assert 3 <= len(tokens) <= 40
            assert all(token == "." or token == "," or token.isalpha() for token in tokens), line


def test_vocabulary_sizes_and_reported_stats(default_corpus):
    stats = default_corpus["result"]["stats"]
    for side, lang in enumerate(("en", "fr")):
        vocabulary = {token for pair in default_corpus["pairs"]["train"] for token in pair[side].split()}
        assert len(vocabulary) >= 1000
        assert stats[lang]["vocabulary"] == len(vocabulary)
        lengths = [len(pair[side].split()) for pair in all_pairs(default_corpus)]
        assert stats[lang]["min_length"] == min(lengths) and stats[lang]["max_length"] == max(lengths)
        assert stats[lang]["mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert 12.0 <= stats["en"]["mean_length"] <= 15.0
    assert stats["en"]["min_length"] == 3


def test_same_seed_same_bytes_and_different_seed_differs(tmp_path):
    def generate(name, seed):
        synthetic.generate_corpus(str(tmp_path / name), n_train=300, n_valid=20, n_test=20, seed=seed)
        return {f: (tmp_path / name / f).read_bytes() for f in sorted(os.listdir(tmp_path / name))}

    first, again, other = generate("a", 7), generate("b", 7), generate("c", 8)
    assert sorted(first) == ["test.en", "test.fr", "train.en", "train.fr", "valid.en", "valid.fr"]
    assert first == again
    assert all(first[name] != other[name] for name in first)
    pairs = [synthetic.make_sentence_pair(random.Random(3)) for _ in range(2)]
    assert pairs[0] == pairs[1]


def test_max_depth_controls_recursion():
    def source_lines(max_depth):
        rng = random.Random(11)
        return [synthetic.make_sentence_pair(rng, max_depth=max_depth)[0] for _ in range(2000)]

    def mean_length(lines):
        return sum(len(line.split()) for line in lines) / len(lines)

    flat, shallow, default, deep = (source_lines(depth) for depth in (0, 1, 2, 4))
    recursive_words = {"that", "because", "when", "if", "although", "and", "but", "or", "of", "in", "on"}
    assert not any(recursive_words.intersection(line.split()) for line in flat)
    assert mean_length(flat) + 3 < mean_length(shallow) < mean_length(default)
    assert max(len(line.split()) for line in flat) < 20
    assert max(len(line.split()) for line in deep) == 40  # deeper trees hit the length cap


def test_lemma_frequencies_are_zipf_like(default_corpus):
    noun_of_form = {}
    for noun in LEXICON.nouns:
        noun_of_form[noun.source] = noun_of_form[noun.source + "s"] = noun
    counts = collections.Counter(noun_of_form[token] for source, _ in default_corpus["pairs"]["train"]
                                 for token in source.split() if token in noun_of_form)
    ranked = [count for _, count in counts.most_common()]
    assert len(counts) >= 0.95 * len(LEXICON.nouns)  # the tail is still seen
    assert ranked[0] > 20 * ranked[len(ranked) // 2]  # but the head dominates


def test_every_construction_occurs(default_corpus):
    """Each closed-class marker of a construction is frequent enough to be learned."""
    counts = [collections.Counter(token for pair in default_corpus["pairs"]["train"] for token in pair[side].split())
              for side in (0, 1)]
    source_markers = "does did not that because when if although and but or , am is are was were these two".split()
    target_markers = ("ne pas qui que puisque lorsque si quoique et mais ou , du au aux des "
                      "ai as a avons ont suis es est sommes sont étais était étions étaient").split()
    for side, markers in ((0, source_markers), (1, target_markers)):
        rare = {marker: counts[side][marker] for marker in markers if counts[side][marker] < 30}
        assert not rare


def test_cli_prints_summary_and_writes_files(tmp_path):
    out_dir = tmp_path / "cli"
    completed = subprocess.run(
        [sys.executable, "-m", "fastgen_demo.synthetic", str(out_dir),
         "--train", "40", "--valid", "5", "--test", "6", "--seed", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "train 40" in completed.stdout and "test 6" in completed.stdout
    assert "vocabulary" in completed.stdout and "mean" in completed.stdout
    assert len(read_lines(out_dir / "train.fr")) == 40
    assert len(read_lines(out_dir / "test.en")) == 6


# ---------------------------------------------------------------------------
# structure of sentences built from known trees

THE = by_source(synthetic.DETERMINERS, "the")
HE = by_source(synthetic.PRONOUNS, "he")


def noun_phrase(noun, plural=False, adjectives=(), **kwargs):
    return synthetic.NounPhrase(noun, THE, plural, tuple(adjectives), **kwargs)


@pytest.mark.parametrize("feminine", [False, True])
@pytest.mark.parametrize("plural", [False, True])
def test_adjectives_follow_the_noun_and_agree(feminine, plural):
    noun = noun_with(feminine)
    first, second = LEXICON.adjectives[3], LEXICON.adjectives[7]
    verb = LEXICON.intransitive_verbs[0]
    clause = synthetic.Clause(noun_phrase(noun, plural, [first, second]), verb=verb)
    source, target = synthetic.render_sentence(clause)

    source_noun = noun.source + ("s" if plural else "")
    source_verb = verb.source + ("" if plural else "s")
    assert source.split() == ["the", first.source, second.source, source_noun, source_verb, "."]
    suffix = ADJECTIVE_SUFFIX[(feminine, plural)]
    assert target.split() == [DEFINITE_ARTICLE[(feminine, plural)], noun.target + ("s" if plural else ""),
                              second.target + suffix, first.target + suffix,
                              verb.target + ("ent" if plural else "e"), "."]

    predicate = LEXICON.adjectives[11]
    source, target = synthetic.render_sentence(synthetic.Clause(noun_phrase(noun, plural), predicate=predicate))
    assert source.split() == ["the", source_noun, "are" if plural else "is", predicate.source, "."]
    assert target.split() == [DEFINITE_ARTICLE[(feminine, plural)], noun.target + ("s" if plural else ""),
                              "sont" if plural else "est", predicate.target + suffix, "."]


def test_adverb_moves_after_the_verb_and_past_uses_auxiliary():
    verb, adverb, noun = LEXICON.transitive_verbs[2], LEXICON.adverbs[1], noun_with(False, 4)
    present = synthetic.Clause(HE, verb=verb, object=noun_phrase(noun), adverb=adverb)
    source, target = synthetic.render_sentence(present)
    assert source.split() == ["he", adverb.source, verb.source + "s", "the", noun.source, "."]
    assert target.split() == ["il", verb.target + "e", adverb.target, "le", noun.target, "."]

    past = synthetic.Clause(HE, verb=verb, object=noun_phrase(noun), adverb=adverb, past=True)
    source, target = synthetic.render_sentence(past)
    assert source.split() == ["he", adverb.source, verb.source + "ed", "the", noun.source, "."]
    assert target.split() == ["il", "a", adverb.target, verb.target + "é", "le", noun.target, "."]


def test_negation_wraps_the_target_verb():
    she, we = by_source(synthetic.PRONOUNS, "she"), by_source(synthetic.PRONOUNS, "we")
    verb, noun = LEXICON.transitive_verbs[0], noun_with(True, 2)
    source, target = synthetic.render_sentence(
        synthetic.Clause(she, verb=verb, object=noun_phrase(noun), negated=True))
    assert source.split() == ["she", "does", "not", verb.source, "the", noun.source, "."]
    assert target.split() == ["elle", "ne", verb.target + "e", "pas", "la", noun.target, "."]

    adjective = LEXICON.adjectives[0]
    source, target = synthetic.render_sentence(
        synthetic.Clause(we, predicate=adjective, negated=True, past=True))
    assert source.split() == ["we", "were", "not", adjective.source, "."]
    assert target.split() == ["nous", "ne", "étions", "pas", adjective.target + "s", "."]


@pytest.mark.parametrize("fronted", [False, True])
def test_subordinate_clause_puts_the_target_verb_last(fronted):
    because = by_source(synthetic.SUBORDINATORS, "because")
    main_verb, sub_verb = LEXICON.intransitive_verbs[1], LEXICON.transitive_verbs[5]
    subject, obj = noun_with(True, 1), noun_with(False, 2)
    subordinate = synthetic.Clause(noun_phrase(subject, plural=True), verb=sub_verb,
                                   object=noun_phrase(obj), past=True)
    clause = synthetic.Clause(HE, verb=main_verb,
                              attachment=synthetic.Attachment(because, subordinate, fronted=fronted))
    source, target = synthetic.render_sentence(clause)

    main_source, main_target = ["he", main_verb.source + "s"], ["il", main_verb.target + "e"]
    sub_source = ["because", "the", subject.source + "s", sub_verb.source + "ed", "the", obj.source]
    sub_target = ["puisque", "les", subject.target + "s", "le", obj.target, sub_verb.target + "é", "ont"]
    if fronted:
        assert source.split() == sub_source + [","] + main_source + ["."]
        assert target.split() == sub_target + [","] + main_target + ["."]
    else:
        assert source.split() == main_source + sub_source + ["."]
        assert target.split() == main_target + sub_target + ["."]


def test_relative_clauses_choose_qui_or_que_and_agree_with_the_head():
    head, other = noun_with(True, 3), noun_with(False, 5)
    verb, adjective = LEXICON.transitive_verbs[1], LEXICON.adjectives[2]
    subject_gap = synthetic.Clause(None, predicate=adjective)
    clause = synthetic.Clause(HE, verb=verb, object=noun_phrase(head, plural=True, relative=subject_gap))
    source, target = synthetic.render_sentence(clause)
    assert source.split()[2:] == ["the", head.source + "s", "that", "are", adjective.source, "."]
    assert target.split()[2:] == ["les", head.target + "s", "qui", "sont", adjective.target + "es", "."]

    i = by_source(synthetic.PRONOUNS, "i")
    object_gap = synthetic.Clause(i, verb=verb)
    clause = synthetic.Clause(noun_phrase(other, relative=object_gap), verb=LEXICON.intransitive_verbs[0])
    source, target = synthetic.render_sentence(clause)
    assert source.split()[:5] == ["the", other.source, "that", "i", verb.source]
    assert target.split()[:5] == ["le", other.target, "que", "je", verb.target + "e"]


def test_de_and_a_contract_with_the_article():
    of, to = by_source(synthetic.PREPOSITIONS, "of"), by_source(synthetic.PREPOSITIONS, "to")
    masculine, feminine = noun_with(False, 6), noun_with(True, 6)
    cases = [(of, masculine, False, ["du"]), (of, masculine, True, ["des"]),
             (of, feminine, False, ["de", "la"]), (to, masculine, False, ["au"]),
             (to, feminine, True, ["aux"])]
    for preposition, noun, plural, expected_head in cases:
        modifier = synthetic.PrepPhrase(preposition, noun_phrase(noun, plural))
        clause = synthetic.Clause(noun_phrase(masculine, modifier=modifier), predicate=LEXICON.adjectives[0])
        _, target = synthetic.render_sentence(clause)
        tokens = target.split()
        assert tokens[2:2 + len(expected_head) + 1] == expected_head + [noun.target + ("s" if plural else "")]


# ---------------------------------------------------------------------------
# structure of the generated corpus, read back from the files

def test_target_determiners_agree_with_the_following_noun(default_corpus):
    nouns = target_noun_features()
    checked = 0
    for _, target in all_pairs(default_corpus):
        tokens = target.split()
        for determiner, following in zip(tokens, tokens[1:]):
            if determiner not in TARGET_DETERMINER_FEATURES:
                continue
            if determiner in ("des", "au", "aux", "du") and following not in nouns:
                continue  # 'des' is also a contraction; all four are checked when a noun follows
            feminine, plural = TARGET_DETERMINER_FEATURES[determiner]
            assert following in nouns, target
            _, noun_feminine, noun_plural = nouns[following]
            assert noun_plural == plural, target
            assert feminine is None or noun_feminine == feminine, target
            checked += 1
    assert checked > 20000


def test_target_attributive_adjectives_agree_with_their_noun(default_corpus):
    nouns, adjectives = target_noun_features(), target_adjective_features()
    checked = 0
    for _, target in all_pairs(default_corpus):
        tokens = target.split()
        for position, token in enumerate(tokens):
            if token not in nouns:
                continue
            _, feminine, plural = nouns[token]
            run_end = position + 1
            while run_end < len(tokens) and tokens[run_end] in adjectives:
                run_end += 1
            run = tokens[position + 1:run_end]
            rest = tokens[run_end:]
            if rest[:2] == ["ne", "pas"]:
                rest = rest[2:]
            if run and rest and rest[0] in TARGET_COPULAS:
                run = run[:-1]  # verb-final copular clause: the last adjective is the predicate
            for adjective in run:
                assert adjectives[adjective][1:] == (feminine, plural), target
                checked += 1
    assert checked > 5000


def test_target_verbs_agree_with_pronoun_subjects(default_corpus):
    present_endings = {}
    for verb in LEXICON.transitive_verbs + LEXICON.intransitive_verbs:
        for ending in ("e", "es", "ons", "ent"):
            present_endings[verb.target + ending] = ending
    checked = collections.Counter()
    for _, target in all_pairs(default_corpus):
        tokens = target.split()
        for pronoun, following in zip(tokens, tokens[1:]):
            if pronoun not in PRONOUN_AGREEMENT:
                continue
            ending, auxiliary, copula = PRONOUN_AGREEMENT[pronoun]
            if following in present_endings:
                assert present_endings[following] == ending, target
                checked[pronoun] += 1
            elif following in {"ai", "as", "a", "avons", "ont", "suis", "es", "est", "sommes", "sont"}:
                assert following in (auxiliary, copula), target
                checked[pronoun] += 1
    assert set(checked) == set(PRONOUN_AGREEMENT) and min(checked.values()) > 100


def test_source_nouns_carry_the_plural_suffix(default_corpus):
    singular = {noun.source for noun in LEXICON.nouns}
    plural = {noun.source + "s" for noun in LEXICON.nouns}
    adjectives = {adjective.source for adjective in LEXICON.adjectives}
    checked = 0
    for source, _ in all_pairs(default_corpus):
        tokens = source.split()
        for position, token in enumerate(tokens):
            if token in SOURCE_PLURAL_DETERMINERS or token in SOURCE_SINGULAR_DETERMINERS:
                following = position + 1
                while tokens[following] in adjectives:
                    following += 1
                expected = plural if token in SOURCE_PLURAL_DETERMINERS else singular
                assert tokens[following] in expected, source
                checked += 1
    assert checked > 10000


def test_open_class_words_translate_one_to_one(default_corpus):
    """Every source lemma has exactly one target counterpart in the same sentence pair."""
    source_lemma, target_lemma = {}, {}
    for noun in LEXICON.nouns:
        for suffix in ("", "s"):
            source_lemma[noun.source + suffix] = target_lemma[noun.target + suffix] = noun
    for adjective in LEXICON.adjectives:
        source_lemma[adjective.source] = adjective
        for suffix in ADJECTIVE_SUFFIX.values():
            target_lemma[adjective.target + suffix] = adjective
    for adverb in LEXICON.adverbs:
        source_lemma[adverb.source] = target_lemma[adverb.target] = adverb
    for verb in LEXICON.transitive_verbs + LEXICON.intransitive_verbs:
        for suffix in ("", "s", "ed"):
            source_lemma[verb.source + suffix] = verb
        for suffix in ("e", "es", "ons", "ent", "é"):
            target_lemma[verb.target + suffix] = verb
    assert not set(source_lemma) & set(target_lemma)
    for source, target in all_pairs(default_corpus):
        source_counts = collections.Counter(source_lemma[t] for t in source.split() if t in source_lemma)
        target_counts = collections.Counter(target_lemma[t] for t in target.split() if t in target_lemma)
        assert source_counts == target_counts, (source, target)
        assert sum(source_counts.values()) >= 1
