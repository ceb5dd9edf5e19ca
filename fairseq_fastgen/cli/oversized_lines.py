"""fairseq-interactive: a line longer than the model reads is refused alone, not with the whole run.

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
"""

import logging
import sys
from typing import List

import numpy
import torch

logger = logging.getLogger("fairseq_cli.interactive")


class OversizedLines:
    """``make_batches`` for fairseq-interactive that refuses oversized lines one by one."""

    def __init__(self, original_make_batches):
        self.original_make_batches = original_make_batches
        self.lines_seen = 0  # sentence id of the next buffer's first line (fairseq's start_id)
        self.refused: List[int] = []  # sentence ids

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
                self.refuse(first_id + int(index), lengths[index], f"than this model reads (max positions "
                            f"{max_positions})")
        max_tokens = cfg.dataset.max_tokens
        if max_tokens is not None:  # fairseq's batching asserts on these, with or without the skip option
            within = [int(i) for i in fitting if dataset.num_tokens(int(i)) <= max_tokens]
            for index in sorted(set(map(int, fitting)) - set(within)):
                self.refuse(first_id + index, lengths[index], f"than --max-tokens {max_tokens}", skip)
            fitting = within
        return sorted(int(index) for index in fitting)

    def refuse(self, sentence_id, length, limit, skip=False):
        """Report a sentence not translated: refused (the run ends with status 1), or skipped as asked."""
        if skip:
            logger.warning("sentence %d has %d tokens (with eos), more %s; skipped", sentence_id, int(length), limit)
            return
        self.refused.append(sentence_id)
        print(f"fairseq-interactive: sentence {sentence_id} has {int(length)} tokens (with eos), more {limit}; "
              f"not translated. Shorten it, or pass --skip-invalid-size-inputs-valid-test to skip such lines "
              f"without an error.", file=sys.stderr, flush=True)

    def exit_if_refused(self):
        """After the input: exit with status 1 naming every refused sentence, if any."""
        if self.refused:
            ids = ", ".join(map(str, sorted(self.refused)))
            raise SystemExit(f"fairseq-interactive: {len(self.refused)} of {self.lines_seen} sentences were too "
                             f"long and not translated (sentence ids {ids}); every other sentence was translated")
