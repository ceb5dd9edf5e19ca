"""A sentence longer than the model reads, or than ``--max-tokens``, is refused alone, not with the whole run.

Stock fairseq-interactive batches each buffer of input lines with fairseq's
batch iterator, which raises on the first line longer than the model's
source positions ("Size of sample #N is invalid ... skip this example with
--skip-invalid-size-inputs-valid-test"), or longer than ``--max-tokens``
(an ``AssertionError``, "Sentences lengths should not exceed max_tokens",
which that option does not skip). The run then ends with a traceback:
the other lines of that buffer are never translated, and neither is any line
after it. With that option, fairseq skips lines beyond the positions with only
a log line.

:class:`OversizedLines` wraps fairseq-interactive's ``make_batches``: without
the option, the lines that fit are batched and translated as before (their
sentence ids unchanged), and each line that does not (beyond the positions or
``--max-tokens``) is reported on stderr with its sentence id, its length and the
limit. At the end of the input the run exits with status 1, naming every refused
sentence, so a script notices. With the option, fairseq's own behaviour is kept
for the positions, and a line beyond ``--max-tokens`` is skipped with a warning
like them instead of ending the run.

fairseq-generate asserts in the same way on a sentence longer than
``--max-tokens`` (its batching); there the plugin leaves that sentence out of
the batches (:class:`OverBudgetSentences`, called by the plugin's
``batch_by_size`` during a fairseq-generate run) and reports it in the same
way: with its sentence id, its length and the limit, then exit status 1 at the
end naming every refused sentence; skipped with a warning under the skip option.

A streamed decoder reads ``--max-tokens`` (or ``--stream-capacity-tokens``) as
the tokens of its running sentences, and fairseq's batching then hands over
whole pools without a token limit: the run holds every sentence to that limit
all the same (:func:`token_limit`), so that every decoder refuses the same
sentences, in the same words.
"""

import logging
import sys
from typing import List, NamedTuple, Optional

import numpy
import torch

logger = logging.getLogger("fairseq_cli.interactive")


class TokenLimit(NamedTuple):
    """The most tokens a sentence of the run may have, and the option that set it."""

    option: str  # "--max-tokens" or "--stream-capacity-tokens"
    tokens: int


def token_limit(cfg, streams: bool, capacity_given: bool) -> Optional[TokenLimit]:
    """The limit every decoder holds a run's sentences to, once the decoder's ``prepare_cli`` has run:
    ``--max-tokens`` as fairseq's batching reads it, or for a streamed decoder (``streams``; fairseq's batching
    then reads whole pools, without a token limit) the stream's token capacity, ``--stream-capacity-tokens``
    (``capacity_given``) or ``--max-tokens`` that set it.  None: no limit, or fairseq's default that its
    batching reads (12000 tokens in fairseq-generate)."""
    if cfg.dataset.max_tokens is not None:
        return TokenLimit("--max-tokens", cfg.dataset.max_tokens)
    tokens = getattr(cfg.generation, "stream_capacity_tokens", None) if streams else None
    if tokens is None:
        return None
    return TokenLimit("--stream-capacity-tokens" if capacity_given else "--max-tokens", tokens)


class SentenceRefusals:
    """Sentences not translated for their length: each reported when found; refused (then named again at the end,
    exit status 1) or, under --skip-invalid-size-inputs-valid-test, skipped with a warning."""

    def __init__(self, program: str):
        self.program = program
        self.refused: List[int] = []  # sentence ids

    def refuse(self, sentence_id, length, limit, skip=False):
        if skip:
            logger.warning("sentence %d has %d tokens (with eos), more %s; skipped", sentence_id, int(length), limit)
            return
        self.refused.append(sentence_id)
        print(f"{self.program}: sentence {sentence_id} has {int(length)} tokens (with eos), more {limit}; "
              f"not translated. Shorten it, or pass --skip-invalid-size-inputs-valid-test to skip such sentences "
              f"without an error.", file=sys.stderr, flush=True)

    def exit_if_refused(self, total):
        """After the run: exit with status 1 naming every refused sentence, if any (``total``: sentences read)."""
        if self.refused:
            ids = ", ".join(map(str, sorted(self.refused)))
            raise SystemExit(f"{self.program}: {len(self.refused)} of {total} sentences were too long and not "
                             f"translated (sentence ids {ids}); every other sentence was translated")


class OversizedLines:
    """``make_batches`` for fairseq-interactive that refuses oversized lines one by one."""

    def __init__(self, original_make_batches, limit: Optional[TokenLimit] = None):
        self.original_make_batches = original_make_batches
        self.limit = limit  # the run's token limit (token_limit)
        self.lines_seen = 0  # sentence id of the next buffer's first line (fairseq's start_id)
        self.refusals = SentenceRefusals("fairseq-interactive")

    def make_batches(self, lines, cfg, task, max_positions, encode_fn):
        first_id = self.lines_seen
        self.lines_seen += len(lines)
        fitting = self.fitting_lines(lines, cfg, task, max_positions, encode_fn, first_id)
        if len(fitting) == len(lines):
            yield from self.original_make_batches(lines, cfg, task, max_positions, encode_fn)
            return
        original_index = torch.as_tensor(fitting, dtype=torch.long)  # position among the fitting lines -> in `lines`
        fitting_lines = [lines[index] for index in fitting]
        for batch in self.original_make_batches(fitting_lines, cfg, task, max_positions, encode_fn):
            yield batch._replace(ids=original_index[batch.ids])

    def fitting_lines(self, lines, cfg, task, max_positions, encode_fn, first_id) -> List[int]:
        """Indices of the lines the model can read in one batch, in order; reports or skips the others."""
        # lexical constraints follow the sentence after a tab (fairseq strips them the same way)
        texts = [line.split("\t", 1)[0] for line in lines] if cfg.generation.constraints else lines
        tokens, lengths = task.get_interactive_tokens_and_lengths(texts, encode_fn)
        dataset = task.build_dataset_for_inference(tokens, lengths)
        indices = numpy.arange(len(lines), dtype=numpy.int64)
        skip = cfg.dataset.skip_invalid_size_inputs_valid_test
        if skip:  # fairseq skips those beyond the positions itself
            fitting = indices
        else:
            fitting, too_long = dataset.filter_indices_by_size(indices, max_positions)
            for index in too_long:
                self.refusals.refuse(first_id + int(index), lengths[index], f"than this model reads (max positions "
                                     f"{max_positions})")
        if self.limit is not None:  # fairseq's batching asserts on these, with or without the skip option
            option, max_tokens = self.limit
            within = [int(i) for i in fitting if dataset.num_tokens(int(i)) <= max_tokens]
            for index in sorted(set(map(int, fitting)) - set(within)):
                self.refusals.refuse(first_id + index, lengths[index], f"than {option} {max_tokens}", skip)
            fitting = within
        return sorted(int(index) for index in fitting)

    def exit_if_refused(self):
        """After the input: exit with status 1 naming every refused sentence, if any."""
        self.refusals.exit_if_refused(self.lines_seen)


class OverBudgetSentences:
    """During a fairseq-generate run: the sentences longer than ``--max-tokens``, left out of the batches."""

    def __init__(self, skip: bool, limit: Optional[TokenLimit] = None):
        self.skip = skip  # --skip-invalid-size-inputs-valid-test
        self.limit = limit  # a streamed decoder's (token_limit): fairseq's batching then has no max_tokens
        self.refusals = SentenceRefusals("fairseq-generate")
        self.left_out = 0

    def leave_out(self, indices, options: dict):
        """``indices`` (dataset indices: sentence ids) and ``options`` (keywords of fairseq's ``batch_by_size``)
        without the sentences longer than ``max_tokens`` (or the run's limit), each of them refused or skipped."""
        limit = TokenLimit("--max-tokens", options["max_tokens"]) if options.get("max_tokens") else self.limit
        if limit is None:
            return indices, options
        option, max_tokens = limit
        indices = numpy.asarray(indices)
        num_tokens = options.get("num_tokens_vec")  # (len(indices),) or None: ask num_tokens_fn
        lengths = num_tokens if num_tokens is not None else numpy.array(
            [options["num_tokens_fn"](int(index)) for index in indices], dtype=numpy.int64)
        over = lengths > max_tokens
        for index, length in sorted(zip(indices[over].tolist(), lengths[over].tolist())):
            self.refusals.refuse(int(index), length, f"than {option} {max_tokens} (the longer of its source and "
                                 "target)", self.skip)
        self.left_out += int(over.sum())
        if num_tokens is not None:
            options = dict(options, num_tokens_vec=num_tokens[~over])
        return indices[~over], options
