"""The decoder-step engine: which runner runs a decoder's steps (``--step-engine``).

* ``fairseq``: fairseq's own incremental decoder (a dict cache grown with ``torch.cat``);
* ``static``: :class:`~fairseq_fastgen.engine.runners.StaticRunner`, preallocated
  buffers, eager, bitwise fairseq's hypotheses;
* ``compiled``: :class:`~fairseq_fastgen.engine.compiled.CompiledRunner`, fixed shapes
  through ``torch.compile`` (the same tokens; scores within float rounding).

A model the engine cannot serve falls back to ``fairseq`` with one warning
saying why; decoders that always run fairseq's step (blockwise; stock beam
search) say so in one info line.
"""

import logging

from fairseq_fastgen.sequence_generators.registry import option_value
from fairseq_fastgen.sequence_generators.runner import ModelRunner

ENGINES = ("fairseq", "static", "compiled")
logger = logging.getLogger("fairseq_fastgen.engine")


def cache_capacity(max_len) -> int:
    """Target positions a cache needs for rows whose length limits are ``max_len`` (rows,): the bos,
    up to ``max_len`` tokens and the forced eos."""
    return int(max_len.max()) + 2 if max_len.numel() else 1


def engine_refusal(model, decoder_name: str, decoder_engines) -> str:
    """Why ``model`` decoded by ``decoder_name`` cannot run on the engine ('' if it can)."""
    from fairseq_fastgen.engine.decoder_step import unsupported_reason

    if "static" not in decoder_engines:
        return f"--decoder {decoder_name} runs on fairseq's step only"
    reason = unsupported_reason(model.decoder)
    return reason or ""


def note_stock_search(gen_cfg, decoder_name: str):
    """fairseq's own SequenceGenerator (``--decoder beam``) keeps fairseq's step: say so once."""
    engine = option_value(gen_cfg, "step_engine")
    if engine != "fairseq":
        logger.info(f"--step-engine {engine}: --decoder {decoder_name} is fairseq's own search, which runs "
                       f"fairseq's step; using --step-engine fairseq (the plugin's beam searches, var-batch and "
                       f"fixed-stream, run on the engine)")


def build_runner(model, gen_cfg, projection, decoder_name: str, decoder_engines=ENGINES):
    """The runner ``--step-engine`` asks for, or fairseq's with one line saying why not."""
    engine = option_value(gen_cfg, "step_engine")
    temperature = option_value(gen_cfg, "temperature")
    if engine not in ENGINES:
        raise ValueError(f"--step-engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if engine != "fairseq":
        refusal = engine_refusal(model, decoder_name, decoder_engines)
        if refusal:  # a decoder that never runs on the engine says so quietly; a model it cannot serve, aloud
            log = logger.warning if "static" in decoder_engines else logger.info
            log(f"--step-engine {engine}: {refusal}; using --step-engine fairseq")
            engine = "fairseq"
    if engine == "static":
        from fairseq_fastgen.engine.runners import StaticRunner

        return StaticRunner(model, temperature, projection)
    if engine == "compiled":
        from fairseq_fastgen.engine.compiled import CompiledRunner

        return CompiledRunner(model, temperature, projection)
    return ModelRunner(model, temperature, projection)
