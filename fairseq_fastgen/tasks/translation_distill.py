"""``translation_distill``: translation trained on a teacher's outputs.

Sequence-level knowledge distillation (Kim and Rush, 2016) trains a student on
the targets a teacher produced for the training sources.  ``fastgen-distill``
writes those targets as a separate data-bin; this task trains on it::

    fairseq-train DATA --user-dir fairseq_fastgen --task translation_distill \\
        --distilled-data DISTILLED --distill-mix distilled ...

Only the training split (``--train-subset``) is affected; validation and test
splits are always read from ``DATA`` with their original references.
``--distill-mix`` picks the training targets:

* ``original``: the references of ``DATA`` (plain ``translation``);
* ``distilled``: the teacher's outputs, read from ``--distilled-data``;
* ``both``: every source twice, once with each target.

Both data-bins must share their dictionaries; the task refuses otherwise and
names the first differing symbol.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq import utils
from fairseq.data import ConcatDataset, Dictionary
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_fastgen.refusals import UsageError

logger = logging.getLogger(__name__)

DISTILL_MIX_CHOICES = ChoiceEnum(["original", "distilled", "both"])


def dictionary_difference(reference: Dictionary, candidate: Dictionary) -> Optional[str]:
    """None when both dictionaries hold the same symbols in the same order, else a
    phrase naming the first difference (reference first)."""
    for index, (expected, found) in enumerate(zip(reference.symbols, candidate.symbols)):
        if expected != found:
            return f"symbol {index} is {expected!r} in the first and {found!r} in the second"
    shorter, longer = sorted((reference, candidate), key=len)
    if len(shorter) == len(longer):
        return None
    which = "first" if longer is reference else "second"
    return (
        f"the {which} has {len(longer) - len(shorter)} more symbols, "
        f"starting with {longer.symbols[len(shorter)]!r} (symbol {len(shorter)})"
    )


def check_same_dictionaries(reference_dir, candidate_dir, languages, what):
    """Raise UsageError (a ValueError) when ``dict.LANG.txt`` differs between the two directories."""
    for lang in languages:
        reference_path = os.path.join(reference_dir, f"dict.{lang}.txt")
        candidate_path = os.path.join(candidate_dir, f"dict.{lang}.txt")
        difference = dictionary_difference(Dictionary.load(reference_path), Dictionary.load(candidate_path))
        if difference is not None:
            raise UsageError(f"{what}: {reference_path} and {candidate_path} differ: {difference}")


@dataclass
class TranslationDistillConfig(TranslationConfig):
    distilled_data: Optional[str] = field(
        default=None,
        metadata={"help": "data-bin written by fastgen-distill (the teacher's outputs as targets); "
                          "its dictionaries must equal those of DATA"},
    )
    distill_mix: DISTILL_MIX_CHOICES = field(
        default="distilled",
        metadata={"help": "targets of the training split: 'original' (references of DATA), 'distilled' "
                          "(teacher outputs from --distilled-data) or 'both' (every source twice)"},
    )


@register_task("translation_distill", dataclass=TranslationDistillConfig)
class TranslationDistillTask(TranslationTask):
    """Translation whose training split comes from a distilled data-bin (see module doc)."""

    cfg: TranslationDistillConfig

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        mix = str(self.cfg.distill_mix)
        if split != self.cfg.train_subset or mix == "original":
            return super().load_dataset(split, epoch, combine, **kwargs)
        if not self.cfg.distilled_data:
            raise UsageError(f"--distill-mix {mix} needs --distilled-data (a data-bin written by fastgen-distill)")
        distilled_dirs = utils.split_paths(self.cfg.distilled_data)
        distilled_dir = distilled_dirs[(epoch - 1) % len(distilled_dirs)]
        check_same_dictionaries(
            utils.split_paths(self.cfg.data)[0], distilled_dir,
            (self.cfg.source_lang, self.cfg.target_lang), "--distilled-data does not match DATA",
        )
        distilled = self._load_from(distilled_dir, split, epoch, combine, **kwargs)
        if mix == "distilled":
            self.datasets[split] = distilled
            return
        super().load_dataset(split, epoch, combine, **kwargs)
        original = self.datasets[split]
        if len(original) != len(distilled):
            raise UsageError(
                f"split {split!r}: DATA has {len(original)} sentences but --distilled-data has "
                f"{len(distilled)}; was it distilled from this data-bin?"
            )
        self.datasets[split] = ConcatDataset([original, distilled])
        logger.info("%s: %d original + %d distilled pairs", split, len(original), len(distilled))

    def _load_from(self, data_dir, split, epoch, combine, **kwargs):
        """TranslationTask.load_dataset reading ``data_dir`` instead of DATA, so that
        every option of the task (truncation, buckets, padding) applies unchanged."""
        original_data = self.cfg.data
        self.cfg.data = data_dir
        try:
            super().load_dataset(split, epoch, combine, **kwargs)
        finally:
            self.cfg.data = original_data
        return self.datasets[split]
