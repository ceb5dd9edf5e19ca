"""What the plugin changes on the ``EnsembleModel`` of a generator fairseq built.

fairseq's ``SequenceGenerator`` reaches its models only through ``generator.model``,
an ``EnsembleModel``.  :func:`use_ensemble` puts another one there (the step
engine's :class:`~fairseq_fastgen.engine.stock_search.EngineEnsemble`) and
:func:`restore_ensemble` gives fairseq's back; :func:`observing_steps` calls a
function after each decoder step (fastgen-bench's cache measurements).
"""

import contextlib


def use_ensemble(generator, ensemble):
    """``generator`` reaches its models through ``ensemble`` from now on; :func:`restore_ensemble` undoes it."""
    ensemble.stock_ensemble = generator.model  # what restore_ensemble gives back
    generator.model = ensemble


def restore_ensemble(generator) -> bool:
    """Undo :func:`use_ensemble`: the generator's own ensemble again; returns whether it was replaced."""
    stock = getattr(getattr(generator, "model", None), "stock_ensemble", None)
    if stock is None:
        return False
    generator.model = stock
    return True


@contextlib.contextmanager
def observing_steps(generator, observe):
    """Inside the block, ``observe(incremental_states)`` runs after each decoder step of ``generator``'s
    ensemble; afterwards its ``forward_decoder`` is the one before."""
    ensemble = generator.model
    replaced = vars(ensemble).get("forward_decoder")  # a shared cache's (fastseq/shared_cache.py), or None
    forward_decoder = ensemble.forward_decoder

    def observed_forward_decoder(tokens, encoder_outs, incremental_states, temperature=1.0):
        result = forward_decoder(tokens, encoder_outs, incremental_states, temperature)
        observe(incremental_states)
        return result

    ensemble.forward_decoder = observed_forward_decoder
    try:
        yield
    finally:
        if replaced is None:
            del ensemble.forward_decoder
        else:
            ensemble.forward_decoder = replaced
