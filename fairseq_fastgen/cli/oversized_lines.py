"""fairseq-interactive: a line longer than the model reads is refused alone, not with the whole run.

Stock fairseq-interactive batches each buffer of input lines with fairseq's
batch iterator, which raises on the first line longer than the model's
source positions ("Size of sample #N is invalid ... skip this example with
--skip-invalid-size-inputs-valid-test"). The run then ends with a traceback:
the other lines of that buffer are never translated, and neither is any line
after it. With that option, fairseq skips such lines with only a log line.

:class:`OversizedLines` wraps fairseq-interactive's ``make_batches``: without
the option, the lines that fit are batched and translated as before (their
sentence ids unchanged), and each line that does not is reported on stderr
with its sentence id, its length and the limit. At the end of the input the run
exits with status 1, naming every refused sentence, so a script notices. With
the option, fairseq's own behaviour is kept.
"""

import sys
from typing import List

import numpy
import torch


class OversizedLines:
    """``make_batches`` for fairseq-interactive that refuses oversized lines one by one."""

    def __init__(self, original_make_batches):
        self.original_make_batches = original_make_batches
        self.lines_seen = 0  # sentence id of the next buffer's first line (fairseq's start_id)
        self.refused: List[int] = []  # sentence ids

    def make_batches(self, lines, cfg, task, max_positions, encode_fn):
        first_id = self.lines_seen
        self.lines_seen += len(lines)
        if cfg.dataset.skip_invalid_size_inputs_valid_test:
            yield from self.original_make_batches(lines, cfg, task, max_positions, encode_fn)
            return
        fitting = self.fitting_lines(lines, cfg, task, max_positions, encode_fn, first_id)
        if len(fitting) == len(lines):
            yield from self.original_make_batches(lines, cfg, task, max_positions, encode_fn)
            return
        original_index = torch.as_tensor(fitting, dtype=torch.long)  # position among the fitting lines -> in `lines`
        fitting_lines = [lines[index] for index in fitting]
        for batch in self.original_make_batches(fitting_lines, cfg, task, max_positions, encode_fn):
            yield batch._replace(ids=original_index[batch.ids])

    def fitting_lines(self, lines, cfg, task, max_positions, encode_fn, first_id) -> List[int]:
        """Indices of the lines the model can read, in order; reports the others."""
        # lexical constraints follow the sentence after a tab (fairseq strips them the same way)
        texts = [line.split("\t", 1)[0] for line in lines] if cfg.generation.constraints else lines
        tokens, lengths = task.get_interactive_tokens_and_lengths(texts, encode_fn)
        dataset = task.build_dataset_for_inference(tokens, lengths)
        fitting, too_long = dataset.filter_indices_by_size(numpy.arange(len(lines), dtype=numpy.int64), max_positions)
        for index in too_long:
            sentence_id = first_id + int(index)
            self.refused.append(sentence_id)
            print(f"fairseq-interactive: sentence {sentence_id} has {int(lengths[index])} tokens (with eos), more "
                  f"than this model reads (max positions {max_positions}); not translated. Shorten it, or pass "
                  f"--skip-invalid-size-inputs-valid-test to skip such lines without an error.",
                  file=sys.stderr, flush=True)
        return sorted(int(index) for index in fitting)

    def exit_if_refused(self):
        """After the input: exit with status 1 naming every refused sentence, if any."""
        if self.refused:
            ids = ", ".join(map(str, self.refused))
            raise SystemExit(f"fairseq-interactive: {len(self.refused)} of {self.lines_seen} sentences were too "
                             f"long and not translated (sentence ids {ids}); every other sentence was translated")
