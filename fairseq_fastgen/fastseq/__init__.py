"""The FastSeq optimizations (Yan et al., 2021) applied to stock fairseq generation.

* :mod:`.shared_cache`: encoder output and encoder-decoder attention
  keys/values kept once per sentence and shared by its beams
  (off with ``--no-shared-encoder-cache``): on fairseq's own ensemble, for the
  models no runner serves (an ensemble), and in fairseq's runner's cache
  (``encoder_keys_shared_by_beams``, ``engine/fairseq_runner.py``);
* :mod:`.shared_prompt`: for decoder-only ``transformer_lm`` generation, the
  prompt decoded once per sentence and its self-attention keys/values kept
  once per sentence, shared by its beams (off with the same
  ``--no-shared-encoder-cache``, which switches off both shared caches);
* :mod:`.ngram`: ``--no-repeat-ngram-size`` with the plugin's op (stock
  fairseq's CPU path bans nothing);
* :mod:`.beam_loop`: stock beam search's loop with fewer passes over the
  vocabulary per step, same output (off with ``--no-lean-beam-loop``);
* asynchronous post-processing lives with the command line, in
  :mod:`fairseq_fastgen.cli.async_generate` (``--postprocess-workers N``).
"""

import logging

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.fastseq.beam_loop import LeanBeamLoop, leave_lean_beam_loop, use_lean_beam_loop
from fairseq_fastgen.fastseq.ngram import RepeatedNgramBlocker, restore_ngram_blocking, use_fastgen_ngram_blocking
from fairseq_fastgen.fastseq.shared_cache import (
    SharedEncoderAttention,
    encoder_attention_cache_bytes,
    share_encoder_cache,
    shares_encoder_cache,
    supports_shared_cache,
    unshare_encoder_cache,
)
from fairseq_fastgen.fastseq.shared_prompt import (
    SharedPromptAttention,
    prompt_cache_bytes,
    share_prompt_cache,
    shares_prompt_cache,
    supports_shared_prompt,
    unshare_prompt_cache,
)

logger = logging.getLogger("fairseq_fastgen.fastseq")

__all__ = [
    "LeanBeamLoop",
    "RepeatedNgramBlocker",
    "SharedEncoderAttention",
    "SharedPromptAttention",
    "encoder_attention_cache_bytes",
    "optimize_stock_generator",
    "restore_stock_generator",
    "prompt_cache_bytes",
    "share_encoder_cache",
    "share_prompt_cache",
    "shares_encoder_cache",
    "shares_prompt_cache",
    "supports_shared_cache",
    "supports_shared_prompt",
    "use_fastgen_ngram_blocking",
    "use_lean_beam_loop",
]


def optimize_stock_generator(generator, options: PluginOptions, share_cache: bool = True, nbest: int = 1):
    """Apply the optimizations to a generator built by fairseq itself (``--decoder beam``);
    returns it.  Generators without a beam search or a supported model are left as they are; the
    shared caches apply where fairseq's own ensemble runs (no runner serves the models).
    ``--no-shared-encoder-cache`` (or ``share_cache=False``: the step engine keeps its own
    cache) switches off both shared caches: the encoder's (encoder-decoder models) and the
    prompt's (decoder-only language models); ``--no-lean-beam-loop`` keeps fairseq's own search loop;
    ``--stop-at-top-eos`` (with ``nbest``, ``--nbest``) gives the lean loop its stopping rule."""
    if options.stop_at_top_eos and options.no_lean_beam_loop:
        raise ValueError("--stop-at-top-eos is a rule of the plugin's beam loop: drop --no-lean-beam-loop")
    if share_cache and not options.no_shared_encoder_cache:
        share_encoder_cache(generator)
        share_prompt_cache(generator)
    use_fastgen_ngram_blocking(generator)
    if not options.no_lean_beam_loop:
        lean = use_lean_beam_loop(generator, options.stop_at_top_eos, nbest)
        if options.stop_at_top_eos and not lean:
            logger.warning(f"--stop-at-top-eos: {type(generator).__name__} keeps fairseq's own loop, with stock's "
                           f"stopping rule")
    return generator


def restore_stock_generator(generator):
    """Undo :func:`optimize_stock_generator`: the generator, its ensemble and its models' attention modules as
    fairseq built them (the shared caches' attention classes outlive the generator otherwise); returns it."""
    unshare_encoder_cache(generator)
    unshare_prompt_cache(generator)
    restore_ngram_blocking(generator)
    leave_lean_beam_loop(generator)
    return generator
