"""Quality of each configuration: BLEU against the references, identical outputs against a reference configuration."""

from typing import List, Optional

import sacrebleu

from fairseq_fastgen.bench.measure import ConfigResult, as_text

STOCK_DECODER = "beam"  # fairseq's own SequenceGenerator
SAME_DECODER = "self"  # --reference self: each decoder against itself without projection or variant


def corpus_bleu(result: ConfigResult, inputs) -> Optional[float]:
    """sacrebleu's corpus BLEU of the detokenized best hypotheses (None without references)."""
    if inputs.references is None:
        return None
    sentence_ids = sorted(result.outputs)
    hypotheses = [as_text(result.outputs[i], inputs.detokenize) for i in sentence_ids]
    references = [inputs.references[i] for i in sentence_ids]
    return sacrebleu.corpus_bleu(hypotheses, [references]).score


def identical_rate(result: ConfigResult, reference: ConfigResult) -> float:
    """Fraction of sentences whose best hypothesis has exactly the reference's tokens (or printed text)."""
    same = sum(tokens == reference.outputs.get(i) for i, tokens in result.outputs.items())
    return same / len(result.outputs)


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
    for result in measured:
        result.bleu = corpus_bleu(result, inputs)
    for result in measured:
        reference = pick_reference(result, measured, reference_spec)
        if reference is not None:
            result.reference = reference.config.label
            result.identical_rate = identical_rate(result, reference)
            speedup = projection_speedup(result, reference)
            if speedup is not None and reference is not result:
                result.statistics["projection_speedup"] = speedup
