"""Measure configurations: a warm-up pass each (outputs, statistics, peak memory), then interleaved timed passes."""

import logging
import sys
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, List, Optional, Union

import torch
from tqdm import tqdm

from fairseq_fastgen.bench.memory import PeakMemory
from fairseq_fastgen.bench.options import BenchConfig

logger = logging.getLogger("fastgen_bench")

Output = Union[List[int], str]  # a sentence's best hypothesis: token ids, or printed text


class Candidate:
    """What the bench measures: ``decode(batches)`` gives each sentence's best output by sentence id.

    An output is token ids (eos included) or, where the candidate prints text
    (whole fairseq-generate processes), the detokenized hypothesis.
    """

    reads_batches = True  # False: the candidate reads the data itself and ignores the collated batches

    def decode(self, batches) -> Dict[int, Output]:
        raise NotImplementedError

    def statistics(self) -> dict:
        """Decoder counters of the last pass (after the warm-up: of the warm-up)."""
        return {}

    def timed_statistics(self) -> dict:
        """Figures over the timed passes, added to the statistics once they have run."""
        return {}

    def memory_report(self) -> Optional[dict]:
        """Peak memory measured by the candidate itself (None: the bench measures its own process)."""
        return None

    def generated_tokens(self) -> Optional[int]:
        """Tokens of the last pass when the outputs are text (None: count the output token ids)."""
        return None

    def command_line(self) -> Optional[str]:
        """The command a pass runs, where it runs one (whole-process runs)."""
        return None


def as_text(output: Output, detokenize) -> str:
    return output if isinstance(output, str) else detokenize(output)


class FairseqCandidate(Candidate):
    """A generator built by ``task.build_generator``: stock fairseq or a plugin decoder."""

    def __init__(self, task, models, generator, prefix_size: int):
        self.task = task
        self.models = models
        self.generator = generator
        self.prefix_size = prefix_size

    def decode(self, batches) -> Dict[int, torch.Tensor]:
        """Best hypothesis (tokens ending in eos) of every sentence, by sentence id."""
        best = {}
        for sample in batches:
            prefix_tokens = sample["target"][:, : self.prefix_size] if self.prefix_size > 0 else None
            hypotheses = self.task.inference_step(self.generator, self.models, sample, prefix_tokens=prefix_tokens)
            for sentence_id, sentence_hypotheses in zip(sample["id"].tolist(), hypotheses):
                best[sentence_id] = sentence_hypotheses[0]["tokens"]
        return best

    def statistics(self) -> dict:
        counters = getattr(self.generator, "counters", None)
        return counters.as_dict() if counters is not None else {}


@dataclass
class ConfigResult:
    config: BenchConfig
    skipped: Optional[str] = None  # the reason, when the configuration does not apply
    outputs: Dict[int, Output] = field(default_factory=dict)  # sentence id -> best tokens (eos included) or text
    generated_tokens: Optional[int] = None  # set when the outputs are text
    command: Optional[str] = None  # the command of each pass (whole-process runs)
    seconds: List[float] = field(default_factory=list)  # one per timed pass
    memory: dict = field(default_factory=dict)
    statistics: dict = field(default_factory=dict)  # decoder counters of the warm-up pass
    bleu: Optional[float] = None  # over compared_sentences when set, else over every output
    reference: Optional[str] = None  # label of the configuration compared against
    identical_rate: Optional[float] = None  # likewise
    total_sentences: Optional[int] = None  # of the subset measured
    # when the configurations translated different sentences: how many all of them translated (BLEU and
    # identical share are over those), and the BLEU over this configuration's own outputs
    compared_sentences: Optional[int] = None
    own_bleu: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.skipped is None

    @property
    def tokens(self) -> int:
        if self.generated_tokens is not None:
            return self.generated_tokens
        return sum(len(tokens) for tokens in self.outputs.values())

    def rate(self, count: int) -> Dict[str, float]:
        """``count`` per second: median, min and max over the timed passes."""
        rates = [count / seconds for seconds in self.seconds]
        return {"median": median(rates), "min": min(rates), "max": max(rates)}

    def sentences_per_second(self) -> Dict[str, float]:
        return self.rate(len(self.outputs))

    def tokens_per_second(self) -> Dict[str, float]:
        return self.rate(self.tokens)


def warm_up(config, candidate, batches, cuda: bool) -> ConfigResult:
    """The untimed first pass: outputs, decoder statistics and peak memory.

    A ValueError (the decoder refuses this model or these options) propagates:
    the caller reports the configuration as skipped.
    """
    with PeakMemory(cuda) as memory:
        outputs = candidate.decode(batches)
        _synchronize(cuda)
    return ConfigResult(
        config,
        outputs={i: _plain(output) for i, output in outputs.items()},
        generated_tokens=candidate.generated_tokens(),
        command=candidate.command_line(),
        memory=candidate.memory_report() or memory.report,
        statistics=candidate.statistics(),
    )


def _plain(output):
    if isinstance(output, str):
        return output
    return output.tolist() if torch.is_tensor(output) else list(output)


@dataclass
class WarmRun:
    """A configuration past its warm-up, ready for timed passes."""

    result: ConfigResult
    candidate: Candidate
    batches: list


class PassCounter:
    """The passes of a bench run (per configuration one warm-up, one more where its full projection is timed apart,
    and ``repeat`` timed ones): shown by a progress bar on stderr (``disable``: logged as they start instead, as
    fairseq does with --no-progress-bar), and counted here (a disabled bar counts nothing) for the report of a
    stopped run.  ``prepared``: each configuration's Prepared, or its ConfigResult where it was skipped."""

    def __init__(self, prepared: list, repeat: int, disable: bool):
        self.repeat = repeat
        self.total = sum(self.passes_of(p) for p in prepared)
        self.done = 0
        self.running = None  # what the pass under way belongs to
        self.bar = tqdm(total=self.total, unit="pass", file=sys.stderr, disable=disable)

    def passes_of(self, prepared) -> int:
        """The passes of one configuration (also of one skipped before its warm-up)."""
        return 1 + self.repeat + (getattr(prepared, "timer_cfg", None) is not None)

    def start(self, what: str):
        self.running = what
        self.bar.set_description(what)
        if self.bar.disable:
            logger.info("%s", what)

    def update(self, passes: int = 1):
        self.done += passes
        self.bar.update(passes)

    def report(self) -> str:
        under_way = f" ({self.running} under way)" if self.running else ""
        return f"{self.done} of {self.total} passes were run{under_way}"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.bar.close()
        return False


def time_interleaved(runs: List[WarmRun], repeat: int, cuda: bool, progress):
    """``repeat`` rounds, each timing one pass of every configuration in turn.

    Interleaving spreads slow drift (heap growth, clock changes, other jobs on
    the machine) over all configurations alike: timed one configuration after
    the other, whichever ran later paid for it.
    """
    for _ in range(repeat):
        for run in runs:
            _synchronize(cuda)
            start = time.perf_counter()
            run.candidate.decode(run.batches)
            _synchronize(cuda)
            run.result.seconds.append(time.perf_counter() - start)
            progress.update()
    for run in runs:
        run.result.statistics.update(run.candidate.timed_statistics())


def _synchronize(cuda: bool):
    if cuda:
        torch.cuda.synchronize()
