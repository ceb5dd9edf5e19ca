"""Stock fairseq beam search (``--decoder beam``) on a runner: fairseq's own search, the engine's step.

fairseq's ``SequenceGenerator`` (and the plugin's lean loop, ``fastseq/beam_loop.py``)
reaches the model only through its ``EnsembleModel``: ``forward_encoder``,
``reorder_encoder_out``, ``forward_decoder`` and ``reorder_incremental_state``.
:class:`EngineEnsemble` is that ensemble with the encoder call and the decoder
steps answered by an engine runner, the cache reorders by the runner's cache,
and the encoder output no longer reordered once the cache holds what the steps
read of it: the search, its rules and its bookkeeping stay fairseq's, and over
fairseq's runner (``--step-engine fairseq``: fairseq's decoder, the keys shared by
the beams as FastSeq shares them) and the static step its hypotheses are bitwise
stock fairseq's (``tests/engine/test_stock_search.py``).

The runner's cache lives in the search's own incremental state (the dict
fairseq creates per model and hands back at every step), so a generator
serves any number of ``generate`` calls, one after another.
"""

import logging
from typing import Optional

import torch

from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from fairseq_fastgen.adapters.ensemble import use_ensemble
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.engine.choice import compiled_many_rows, compiled_precision, engine_choice, make_runner
from fairseq_fastgen.engine.decoder_step import unsupported_reason

logger = logging.getLogger("fairseq_fastgen.engine")
CACHE_KEY = "fastgen_engine_cache"  # where the runner's cache sits in fairseq's incremental state
STARTED_KEY = "fastgen_engine_started"  # marks an encoder output whose rows a cache has taken


class EngineEnsemble(EnsembleModel):
    """A one-model ``EnsembleModel`` whose decoder steps and cache reorders the engine runs."""

    def __init__(self, models, runner, capacity: int):
        super().__init__(models)
        self.runner = runner
        self.capacity = capacity  # target positions a search may reach (bos and eos included)

    def forward_encoder(self, net_input):
        return [self.runner.encode(net_input)]

    def forward_decoder(self, tokens, encoder_outs, incremental_states, temperature: float = 1.0):
        """lprobs (rows, vocab) and attn (rows, src_len) of the next token; ``temperature`` is the runner's."""
        state = incremental_states[0]
        if CACHE_KEY not in state:
            state[CACHE_KEY] = self.runner.new_cache(self.capacity)
        cache = state[CACHE_KEY]
        step = self.runner.step(tokens, encoder_outs[0], cache)
        if STARTED_KEY not in encoder_outs[0]:  # the cache holds what the steps read of it from now on
            beams = getattr(cache, "beams", 1)
            if beams > 1:  # keys held per sentence: the search's copies of each sentence's rows can go
                first_beams = torch.arange(0, tokens.size(0), beams, device=tokens.device)
                encoder_outs[0] = self.runner.reorder_encoder_out(encoder_outs[0], first_beams)
            encoder_outs[0][STARTED_KEY] = []
        return step

    def reorder_encoder_out(self, encoder_outs, new_order):
        """Once a cache has its encoder-decoder keys/values, the search's encoder output is read for its
        width only: fairseq's reorder at every step (a copy of every row's states) is skipped (and where the
        cache holds them per sentence, the search keeps one row of it per sentence)."""
        if encoder_outs and STARTED_KEY in encoder_outs[0]:
            return encoder_outs
        return super().reorder_encoder_out(encoder_outs, new_order)

    def reorder_incremental_state(self, incremental_states, new_order):
        cache = incremental_states[0].get(CACHE_KEY)
        if cache is not None:
            self.runner.reorder_cache(cache, new_order)


def stock_search_refusal(generator, models) -> Optional[str]:
    """Why fairseq's search in ``generator`` cannot run on the engine (None if it can)."""
    if not isinstance(generator, SequenceGenerator) or type(generator.model) is not EnsembleModel:
        return f"{type(generator).__name__} is not fairseq's SequenceGenerator"
    if len(models) != 1:
        return f"an ensemble of {len(models)} models runs on fairseq's step"
    if not generator.model.has_encoder():
        return "a model without an encoder runs on fairseq's step"
    return unsupported_reason(models[0].decoder)


def run_stock_search_on_engine(generator, models, engine: str, freezing: bool = False,
                               background: bool = False, share_keys: bool = True,
                               precision: Optional[str] = None, many_rows: str = "unit") -> bool:
    """Give ``generator`` (fairseq's ``--decoder beam``) an :class:`EngineEnsemble` of ``engine``'s
    runner (:func:`fairseq_fastgen.adapters.ensemble.use_ensemble`); returns whether it did (otherwise one line
    says why, and fairseq's step runs).  ``share_keys``: the beams of a sentence share its encoder-decoder
    keys/values in the runner's cache, else each beam keeps its copy; ``precision``, ``many_rows``:
    ``choice.compiled_precision``'s, ``choice.compiled_many_rows``'s."""
    refusal = stock_search_refusal(generator, models)
    if refusal:
        if engine != "fairseq":  # under fairseq's engine, fairseq's ensemble is what was asked for
            logger.warning(f"--step-engine {engine}: {refusal}; using --step-engine fairseq")
        return False
    runner = make_runner(engine, models[0], generator.temperature, getattr(generator, "projection", None), freezing,
                         generator.beam_size if share_keys else 1, background, precision=precision,
                         many_rows=many_rows)
    use_ensemble(generator, EngineEnsemble(models, runner, generator.max_len + 2))  # undone by restore_ensemble
    return True


def serve_stock_search(generator, models, options: PluginOptions) -> bool:
    """fairseq's own SequenceGenerator (``--decoder beam``) over a runner: fairseq's search loop over the
    engine's step (``stock_search.py``; on ``fairseq`` and ``static`` bitwise stock fairseq's hypotheses);
    returns whether a runner serves it (not for an ensemble, a model without an encoder or one the engines
    cannot serve: fairseq's own ensemble then runs, with FastSeq's shared caches where they apply).
    ``--no-shared-encoder-cache``: every beam keeps its own copy of the encoder-decoder keys/values."""
    choice = engine_choice(options, models[0])
    return run_stock_search_on_engine(generator, models, choice.engine, choice.freezing, choice.background,
                                      not options.no_shared_encoder_cache, compiled_precision(options),
                                      compiled_many_rows(options))
