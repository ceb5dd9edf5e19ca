"""The plugin's generator: fairseq's generator interface around a search policy.

``FastgenGenerator.generate(models, sample, ...)`` returns, like fairseq's
SequenceGenerator, one list of hypotheses per sentence of ``sample``, each a
dict with ``tokens`` (ending in eos), ``score``, ``positional_scores``,
``attention`` and ``alignment``.  Three roles are kept apart:

* the **scheduler** decides which sentences are decoded in each iteration
  (all of the batch; or streamed with refills, see ``streaming.py``);
* the **search policy** decides what survives an iteration (greedy argmax,
  blockwise verify/accept, beam pruning);
* the **runner** runs the model (encoder, incremental step, projection).
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from fairseq_fastgen.cluster.choice import projection_from_options
from fairseq_fastgen.cluster.screened import certified_top
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.options import FastgenOptions, parse_options
from fairseq_fastgen.counters import FEWER_THAN_NBEST, GenerationCounters
from fairseq_fastgen.sequence_generators.processors import (
    StepRows,
    apply_processors,
    build_processors,
    reads_tokens,
    row_max_len,
)
from fairseq_fastgen.engine import build_runner, cache_capacity
from fairseq_fastgen.sequence_generators.state import DecodingState

logger = logging.getLogger("fairseq_fastgen.generator")


@dataclass
class SourcePool:
    """The sentences of one ``generate`` call, addressed by their position in it."""

    net_input: Dict[str, Tensor]  # src_tokens (sentences, src_len), src_lengths (sentences,)
    src_lengths: Tensor  # (sentences,) real length without pad / eos
    max_len: Tensor  # (sentences,) length limit of each hypothesis
    prefix_tokens: Optional[Tensor]  # (sentences, prefix_len) or None
    pad: int  # padding symbol of the source

    def __post_init__(self):
        self.source_len = self.net_input["src_tokens"].ne(self.pad).sum(dim=1)  # (sentences,) tokens with eos

    @property
    def size(self) -> int:
        return self.src_lengths.size(0)

    def pull(self) -> int:
        """Sentences that arrived since the pool was made: none (a live pool grows, ``live_stream.py``)."""
        return 0

    def admitted(self, count: int):
        """The next ``count`` sentences entered the decoding (a live pool lets go of their tokens)."""

    def inputs_of(self, sentences: Tensor) -> Dict[str, Tensor]:
        """net_input of the given sentences (the pool's own when they are all of it, in order)."""
        if torch.equal(sentences, torch.arange(self.size, device=sentences.device)):
            return self.net_input
        return self.subset(sentences)

    def subset(self, index: Tensor) -> Dict[str, Tensor]:
        """net_input of the given sentences, re-padded to their own longest source."""
        src_tokens = self.net_input["src_tokens"].index_select(0, index)
        lengths = self.net_input["src_lengths"].index_select(0, index)
        pad = self.pad
        width = int(src_tokens.ne(pad).sum(1).max()) if src_tokens.numel() else 0
        left_padded = bool(src_tokens.size(1) and src_tokens[:, -1].ne(pad).all())
        src_tokens = src_tokens[:, -width:] if left_padded else src_tokens[:, :width]
        return {"src_tokens": src_tokens, "src_lengths": lengths}


class DecodeContext:
    """What a policy needs during one ``generate`` call (and where results go)."""

    def __init__(self, runner, processors, pool, eos, lenpen, normalize_scores, nbest, counters):
        self.runner = runner
        self.processors = processors
        self.reads_tokens = reads_tokens(processors)  # some processor reads the rows' tokens (prefix, n-grams)
        self.pool = pool
        self.eos = eos
        self.lenpen = lenpen
        self.normalize_scores = normalize_scores
        self.nbest = nbest
        self.counters = counters
        self.results: List[Optional[List[Dict[str, Tensor]]]] = [None] * pool.size

    # ---- model ----------------------------------------------------------------
    def start_state(self, sentences: Tensor) -> DecodingState:
        """Encode the given pool sentences; one row per sentence."""
        net_input = self.pool.inputs_of(sentences)
        encoder_out = self.runner.encode(net_input)
        self.counters.add("encoder_calls")
        bos = torch.full((sentences.numel(), 1), self.eos, dtype=torch.long, device=sentences.device)
        return DecodingState(
            self.runner, bos, sentences.clone(), self.pool.max_len.index_select(0, sentences),
            encoder_out, self.runner.new_cache(cache_capacity(self.pool.max_len)), net_input["src_tokens"].size(1),
        )

    def next_lprobs(self, state: DecodingState):
        """Run the model for every row of ``state``; processed lprobs (rows, vocab), attn."""
        lprobs, attn = self.runner.step(state.tokens, state.encoder_out, state.cache)
        self.counters.add("model_calls")
        self.process(lprobs, StepRows.of_state(state))
        return lprobs, attn

    def process(self, lprobs: Tensor, rows: StepRows):
        """The step processors on ``lprobs`` (N, vocab) of ``rows``, in place."""
        apply_processors(self.processors, lprobs, rows)

    # ---- results ----------------------------------------------------------------
    def hypothesis(self, state: DecodingState, row: int) -> Dict[str, Tensor]:
        """A finished row of ``state`` (its last token is eos) in fairseq's hypothesis format."""
        length = state.row_length(row)
        cum = state.cum_scores[row, :length]  # (length,)
        positional = cum.clone()
        positional[1:] = cum[1:] - cum[:-1]
        # copies, never views of the state: a streamed row's place is taken by another sentence's row
        score = cum[-1] / (length ** self.lenpen) if self.normalize_scores else cum[-1].clone()
        attention = torch.empty(0) if state.attn is None else state.attn[row, :, :length].clone()  # (src_len, length)
        return {
            "tokens": state.tokens[row, 1: 1 + length].clone(),
            "score": score,
            "attention": attention,
            "alignment": torch.empty(0),
            "positional_scores": positional,
        }

    def finish(self, sentence: int, hypotheses: List[Dict[str, Tensor]]):
        """Record the final hypotheses of a sentence (best first)."""
        if self.results[sentence] is not None:
            raise RuntimeError(f"sentence {sentence} finished twice")
        ranked = sorted(hypotheses, key=lambda h: float(h["score"]), reverse=True)
        self.results[sentence] = ranked[: self.nbest]
        self.counters.add("sentences")
        if len(ranked) < self.nbest:  # a variable-width beam can end with fewer candidates: reported at the end
            self.counters.add(FEWER_THAN_NBEST)
        self.counters.add("tokens", ranked[0]["tokens"].numel())


class StaticScheduler:
    """All sentences of the call start together and run until each finishes."""

    def run(self, policy, ctx: DecodeContext):
        sentences = torch.arange(ctx.pool.size, device=ctx.pool.src_lengths.device)
        state = policy.start(ctx.start_state(sentences), ctx)
        while state.rows > 0:
            policy.advance(state, ctx)
            ctx.counters.add("iterations")


class FastgenGenerator(nn.Module):
    """Base of the plugin's decoders; subclasses set ``name`` and build a policy.

    ``gen_cfg``: fairseq's generation options (``--lenpen``, ``--max-len-b``, ...); ``common``: the plugin's
    options every decoder shares (``--step-engine``: the runner)."""

    name = "?"

    def __init__(self, model, tgt_dict, gen_cfg, common: PluginOptions, policy, scheduler=None, projection=None):
        super().__init__()
        self.model = model
        self.tgt_dict = tgt_dict
        self.gen_cfg = gen_cfg
        self.policy = policy
        self.scheduler = scheduler or StaticScheduler()
        self.eos = tgt_dict.eos()
        self.pad = tgt_dict.pad()
        self.symbols_to_strip_from_output = {self.eos}
        self.runner = build_runner(model, common, gen_cfg.temperature, projection)
        self.counters = self.new_counters()
        if hasattr(projection, "statistics"):
            self.counters.stats_sources.append(projection.statistics.as_dict)
        if hasattr(self.runner, "statistics"):  # the compiled engine: its buckets and compile time
            self.counters.stats_sources.append(self.runner.statistics)
        self.nbest = 1
        self.live = None  # fairseq-interactive with a streaming decoder: one LiveStream across calls

    def new_counters(self):
        return GenerationCounters(self.name)

    @classmethod
    def from_config(cls, models, tgt_dict, gen_cfg, options: Optional[FastgenOptions] = None, **extra):
        """``options``: the plugin's options read from ``gen_cfg`` (read here when not given).
        ``extra``: the task's generator arguments; ``direction``, the run's (source, target) languages,
        picks the file of ``--cluster-projection DIR``; ``symbols_to_strip_from_output`` (a multilingual
        task's target language token) is left out of the printed output, as by fairseq's generator."""
        if options is None:
            options = parse_options(gen_cfg)
        model = single_model(cls.name, models)
        reject_unsupported(cls.name, gen_cfg, extra)
        top = certified_top(gen_cfg.beam, options.by_name().get("blockwise_top_k"))
        projection = build_projection(options.common, gen_cfg.temperature, model, extra.get("direction"), top)
        generator = cls.build(model, tgt_dict, gen_cfg, options, projection=projection)
        generator.symbols_to_strip_from_output |= set(extra.get("symbols_to_strip_from_output") or ())
        return generator

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options: FastgenOptions, projection=None):
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        if constraints is not None:
            raise ValueError(f"--decoder {self.name} does not support lexical constraints")
        if bos_token is not None and bos_token != self.eos:
            raise ValueError(f"--decoder {self.name} starts from eos; bos_token={bos_token} is not supported")
        if self.model.training:  # a generator built once may serve validation during training
            self.model.eval()
        if self.live is not None:
            if prefix_tokens is not None:
                raise ValueError(f"--decoder {self.name} in fairseq-interactive takes no prefix tokens")
            return self.live.answer(sample["net_input"])
        pool = self.make_pool(sample["net_input"], prefix_tokens)
        ctx = DecodeContext(
            self.runner, build_processors(self.tgt_dict, self.gen_cfg, prefix_tokens), pool,
            self.eos, self.gen_cfg.lenpen, not self.gen_cfg.unnormalized, self.nbest, self.counters,
        )
        self.scheduler.run(self.policy, ctx)
        missing = [i for i, r in enumerate(ctx.results) if r is None]
        if missing:
            raise RuntimeError(f"--decoder {self.name} lost sentences {missing[:10]} (a bug: please report)")
        return ctx.results

    def make_pool(self, net_input, prefix_tokens):
        src_tokens = net_input["src_tokens"]
        source_widths = src_tokens.ne(self.pad).long().sum(dim=1)  # (sentences,) eos included
        src_lengths = source_widths - src_tokens.eq(self.eos).long().sum(dim=1)  # (sentences,) without eos
        max_positions = self.model.max_decoder_positions()
        return SourcePool(
            net_input, src_lengths, row_max_len(source_widths, self.gen_cfg, max_positions), prefix_tokens, self.pad
        )


def single_model(name, models):
    if len(models) != 1:
        raise ValueError(f"--decoder {name} decodes with one model; got an ensemble of {len(models)}")
    return models[0]


def reject_unsupported(name, gen_cfg, extra):
    if extra.get("lm_model") is not None:
        raise ValueError(f"--decoder {name} does not support shallow fusion (--lm-path); use --decoder beam")
    if extra.get("prefix_allowed_tokens_fn") is not None:
        raise ValueError(f"--decoder {name} does not support prefix_allowed_tokens_fn; use --decoder beam")
    for option in ("sampling", "diverse_beam_groups", "match_source_len"):
        value = getattr(gen_cfg, option, None)
        if value and value not in (-1, False):
            raise ValueError(f"--decoder {name} does not support --{option.replace('_', '-')}; use --decoder beam")


def build_projection(options: PluginOptions, temperature, model, direction=None, top: int = 1):
    return projection_from_options(options, temperature, model, direction, top)


def one_hypothesis_per_sentence(name, gen_cfg):
    """The one rule of the decoders that produce one hypothesis per sentence (greedy, blockwise and their
    streamed forms): ``--beam`` is not theirs to read, fairseq's default 5 included, and one other than 1 is
    named in one warning line; ``--nbest`` above 1 is refused."""
    if gen_cfg.nbest > 1:
        raise UsageError(f"--decoder {name} produces one hypothesis per sentence; got --nbest {gen_cfg.nbest}")
    if gen_cfg.beam != 1:
        logger.warning(f"--decoder {name} decodes one hypothesis per sentence: --beam {gen_cfg.beam} is not used")
