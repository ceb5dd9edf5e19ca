"""Quality of each configuration: BLEU against the references, identical outputs against a reference configuration.

Rows are compared over the same sentences.  When the configurations did not all
translate the same sentences (stock fairseq-generate drops the last batch when
its size is not a multiple of ``--required-batch-size-multiple``), every row's
BLEU and identical share are computed over the sentences that every measured
configuration translated, and the row records how many that was
(``compared_sentences``) beside its BLEU over its own sentences.
"""

from typing import Iterable, List, Optional, Set

import sacrebleu

from fairseq_fastgen.bench.measure import ConfigResult, as_text

STOCK_DECODER = "beam"  # fairseq's own SequenceGenerator
SAME_DECODER = "self"  # --reference self: each decoder against itself without projection or variant


def corpus_bleu(result: ConfigResult, inputs, over: Optional[Iterable[int]] = None) -> Optional[float]:
    """sacrebleu's corpus BLEU of the detokenized best hypotheses of the sentences ``over`` (default: every
    sentence ``result`` translated); None without references."""
    if inputs.references is None:
        return None
    sentence_ids = sorted(result.outputs if over is None else over)
    hypotheses = [as_text(result.outputs[i], inputs.detokenize) for i in sentence_ids]
    references = [inputs.references[i] for i in sentence_ids]
    # force: sacrebleu's warning about tokenized-looking output (a '.' after a space) is noise here, where
    # every row is scored on the same post-processed text; it would repeat for every row
    return sacrebleu.corpus_bleu(hypotheses, [references], force=True).score


def identical_rate(result: ConfigResult, reference: ConfigResult, over: Optional[Iterable[int]] = None) -> float:
    """Fraction of the sentences ``over`` (default: every sentence ``result`` translated) whose best hypothesis
    has exactly the reference's tokens (or printed text)."""
    sentence_ids = list(result.outputs if over is None else over)
    same = sum(result.outputs[i] == reference.outputs.get(i) for i in sentence_ids)
    return same / len(sentence_ids)


def common_sentences(measured: List[ConfigResult]) -> Optional[Set[int]]:
    """The sentences every measured configuration translated, when they did not all translate the same ones;
    None when they did (each row is then scored over its own sentences, which are everyone's)."""
    covered = [set(result.outputs) for result in measured]
    if not covered or all(sentences == covered[0] for sentences in covered):
        return None
    return set.intersection(*covered)


def pick_reference(result: ConfigResult, measured: List[ConfigResult], spec: Optional[str]) -> Optional[ConfigResult]:
    """The configuration ``result`` is compared with.

    ``spec`` is a label (that configuration), a decoder name (that decoder at
    the closest beam and batching), ``self`` (the same decoder, without the
    cluster projection or variant), or None: stock beam search so, else the
    first measured configuration.
    """
    if spec is not None and "/" in spec:
        return next((r for r in measured if r.config.label == spec), None)
    decoder = result.config.decoder if spec == SAME_DECODER else (spec or STOCK_DECODER)
    same_decoder = [r for r in measured if r.config.decoder == decoder]
    if not same_decoder:
        return None if spec is not None else (measured[0] if measured else None)

    def closeness(candidate):  # same beam first, then same batching, then the common options, full projection
        config = candidate.config
        return (config.beam != result.config.beam, config.batching != result.config.batching,
                config.variant is not None, config.cluster_projection)

    return min(same_decoder, key=closeness)


def projection_speedup(result: ConfigResult, reference: ConfigResult) -> Optional[float]:
    """The reference's projection time per decoder step over ``result``'s (None unless both timed it)."""
    mine, theirs = (r.statistics.get("projection_ms_per_step") for r in (result, reference))
    return theirs / mine if mine and theirs else None


def score(results: List[ConfigResult], inputs, reference_spec: Optional[str]):
    measured = [r for r in results if r.ok]
    common = common_sentences(measured)
    for result in measured:
        result.total_sentences = len(inputs.sentence_ids)
        result.bleu = corpus_bleu(result, inputs, common)
        if common is not None:
            result.compared_sentences = len(common)
            result.own_bleu = corpus_bleu(result, inputs)
    for result in measured:
        reference = pick_reference(result, measured, reference_spec)
        if reference is not None:
            result.reference = reference.config.label
            result.identical_rate = identical_rate(result, reference, common)
            speedup = projection_speedup(result, reference)
            if speedup is not None and reference is not result:
                result.statistics["projection_speedup"] = speedup
