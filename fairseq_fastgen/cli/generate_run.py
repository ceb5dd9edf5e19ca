"""What the plugin's hooks into fairseq (:mod:`fairseq_fastgen.integration`) report to during one fairseq-generate run.

- Its batching: the split's size (for the report of a stopped run), and the
  sentences longer than ``--max-tokens``, left out of the batches and refused
  alone (:class:`~fairseq_fastgen.cli.oversized_lines.OverBudgetSentences`).
- Its generator: each call starts a batch of the :class:`BatchedOutput` that
  stock fairseq-generate's loop prints to, so that the previous batch, printed
  whole, is written (:mod:`fairseq_fastgen.cli.batched_output`).
"""

from typing import Optional

from fairseq_fastgen.adapters.generate import wrap_generate
from fairseq_fastgen.cli.batched_output import BatchedOutput, WrittenTally
from fairseq_fastgen.cli.oversized_lines import OverBudgetSentences, TokenLimit


class GenerateRun:
    def __init__(self, cfg, limit: Optional[TokenLimit] = None):
        """``limit``: the run's token limit where fairseq's batching does not read it (a streamed decoder)."""
        self.over_budget = OverBudgetSentences(skip=cfg.dataset.skip_invalid_size_inputs_valid_test, limit=limit)
        self.tally = WrittenTally()
        self.output: Optional[BatchedOutput] = None  # the stock loop's output (not with --postprocess-workers)

    def batched(self, dataset):
        """fairseq made the batches of ``dataset``, the split being translated."""
        self.tally.total = len(dataset)

    def watch(self, generator):
        """From now on each call of ``generator.generate`` (one batch) first writes the batch printed before it."""
        wrap_generate(generator, self.generate_batch)

    def generate_batch(self, generate, models, sample, *args, **kwargs):
        if self.output is not None:
            self.output.start_batch(len(sample["id"]))
        return generate(models, sample, *args, **kwargs)

    def exit_if_refused(self):
        """After the run: exit with status 1 naming the sentences refused for their length, if any."""
        self.over_budget.refusals.exit_if_refused(self.tally.total)
