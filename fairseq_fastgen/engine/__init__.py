"""The decoder-step engine: which runner runs a decoder's steps (``--step-engine``).

* ``auto`` (the default): ``compiled`` with frozen row buckets and units compiled in the background on the CPU in
  float32, int8 or bfloat16, ``static`` elsewhere (``choice.py``; ``$FASTGEN_STEP_ENGINE`` names another engine for it);
* ``fairseq``: fairseq's own incremental decoder (a dict cache grown with ``torch.cat``);
* ``static``: :class:`~fairseq_fastgen.engine.runners.StaticRunner`, preallocated
  buffers, eager, bitwise fairseq's hypotheses;
* ``compiled``: :class:`~fairseq_fastgen.engine.compiled.CompiledRunner`, fixed shapes
  through ``torch.compile`` at a few rows and, above them on the CPU, one step for every
  row count compiled ahead of time and kept on disk (the same tokens; scores within
  float rounding).

A model the engine cannot serve falls back to ``fairseq`` with one warning
saying why.  Under ``--quantize int8`` the compiled units compute the decoder's linear layers on int8
rows they read in place (``int8_weights.py``), under ``--quantize bf16`` on bfloat16 weights each unit holds
packed (``bf16_weights.py``); under ``--int8-library-kernels`` ``compiled`` falls back to ``static``, also in one
line.  Blockwise decoding verifies its blocks through the runner's
``step_block`` (several positions per row) on every engine.  Stock beam search (``--decoder beam``) runs fairseq's own
search loop over the engine's step (``stock_search.py``), the beams of a sentence sharing its encoder-decoder
keys/values in the engine's cache; with ``fairseq`` it runs over fairseq's step, sharing them through the
integration layer (``fastseq/shared_cache.py``).
"""

from fairseq_fastgen.engine.choice import (
    ENGINES, build_runner, cache_capacity, engine_refusal, engine_serves, engine_setting, make_runner,
)
from fairseq_fastgen.engine.stock_search import serve_stock_search

__all__ = ["ENGINES", "build_runner", "cache_capacity", "engine_refusal", "engine_serves", "engine_setting",
           "make_runner", "serve_stock_search"]
