"""Decoders are reachable from Python through fairseq's hub interface."""

import pytest

import fairseq_fastgen  # noqa: F401  (registers the decoders)
from fairseq.models.transformer import TransformerModel
from fairseq_fastgen import integration
from fairseq_fastgen.sequence_generators.greedy import GreedyGenerator


@pytest.fixture(scope="module")
def hub(toy_model):
    model = TransformerModel.from_pretrained(
        str(toy_model.checkpoint.parent), checkpoint_file=toy_model.checkpoint.name,
        data_name_or_path=str(toy_model.data_bin), source_lang="en", target_lang="fr",
    )
    return model.eval()


def test_translate_with_decoder_keyword(toy_model, hub):
    sentences = (toy_model.raw / "test.en").read_text().splitlines()[:6]
    stock = hub.translate(sentences, beam=1)
    greedy = hub.translate(sentences, beam=1, decoder="greedy")
    assert isinstance(integration.generators_built[-1], GreedyGenerator)
    assert greedy == stock


def test_unknown_decoder_keyword_is_refused(hub):
    with pytest.raises(ValueError, match=r"unknown --decoder .nope.; choose one of: beam, .*greedy"):
        hub.translate(["a sentence ."], decoder="nope")


def test_another_decoders_option_is_named_once_and_changes_nothing(toy_model, hub, caplog, monkeypatch):
    """--stream-join-lengths and --stream-eps are greedy-stream's: given to greedy they are named in one warning
    line (once a process, however many generators are built), and greedy's output is greedy's."""
    monkeypatch.setattr(integration, "_options_not_read_named", set())
    sentences = (toy_model.raw / "test.en").read_text().splitlines()[:6]
    with caplog.at_level("WARNING", logger="fairseq_fastgen.integration"):
        given = hub.translate(sentences, beam=1, decoder="greedy", stream_join_lengths=True, stream_eps=0.5)
        again = hub.translate(sentences, beam=1, decoder="greedy", stream_join_lengths=True, stream_eps=0.5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fairseq_fastgen.integration"]
    assert warnings == ["--decoder greedy does not read --stream-eps, --stream-join-lengths: not used"]
    assert given == again == hub.translate(sentences, beam=1, decoder="greedy")
    caplog.clear()
    with caplog.at_level("WARNING", logger="fairseq_fastgen.integration"):
        hub.translate(sentences, beam=1, decoder="greedy-stream", stream_eps=0.5)  # its own option: no warning
    assert not [r for r in caplog.records if r.name == "fairseq_fastgen.integration"]
