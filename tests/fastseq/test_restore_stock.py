"""Every change the plugin makes to a generator fairseq built (``--decoder beam``) can be undone:
``integration.restore_stock_generator`` leaves the generator, its ensemble and its models as fairseq made them."""

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.ngram_repeat_block import NGramRepeatBlock
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator

from fairseq_fastgen.engine.stock_search import EngineEnsemble
from fairseq_fastgen.integration import restore_stock_generator
from tests.fastseq.conftest import load
from tests.fastseq.test_shared_cache import assert_bitwise_equal

ENSEMBLE_METHODS = {"forward_decoder", "reorder_encoder_out", "reorder_incremental_state"}


@pytest.mark.parametrize("step_engine,copies", [("fairseq", 2), ("fairseq", 1), ("compiled", 1)])
def test_a_restored_generator_and_its_models_are_stock_again(toy_model, translate, step_engine, copies):
    """``copies``: the ensemble's models (2: fairseq's own ensemble with FastSeq's shared cache, which no runner
    serves; 1: a runner's ensemble)."""
    # loaded afresh: the session's loaded_toy models carry the attention classes other tests' sharing left them
    loaded_toy = load(toy_model.checkpoint, toy_model.data_bin)
    model = loaded_toy.models[0]
    classes = [type(module) for module in model.modules()]
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = GenerationConfig(beam=4, no_repeat_ngram_size=2, step_engine=step_engine)
    models = [model] * copies
    generator = loaded_toy.task.build_generator(models, config)
    translate(loaded_toy, generator, 16, models=models)
    # what the plugin changed: the loop, the blocker, the generate wrappers, and the shared cache's attention
    # classes (fairseq's ensemble) or the engine's ensemble (a runner's)
    assert type(generator) is not SequenceGenerator and "generate" in vars(generator)
    assert type(generator.repeat_ngram_blocker) is not NGramRepeatBlock
    if copies == 2:
        assert [type(module) for module in model.modules()] != classes
    else:
        assert isinstance(generator.model, EngineEnsemble)

    assert restore_stock_generator(generator) is generator
    assert type(generator) is SequenceGenerator and "generate" not in vars(generator)
    assert type(generator.model) is EnsembleModel and not ENSEMBLE_METHODS & set(vars(generator.model))
    assert type(generator.repeat_ngram_blocker) is NGramRepeatBlock
    assert [type(module) for module in model.modules()] == classes
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())
    assert all(module.beam_size == 1 for module in model.modules() if hasattr(module, "beam_size"))
    plain = SequenceGenerator(models, loaded_toy.task.target_dictionary, beam_size=4, no_repeat_ngram_size=2)
    assert_bitwise_equal(translate(loaded_toy, plain, 16, models=models),
                         translate(loaded_toy, generator, 16, models=models))
