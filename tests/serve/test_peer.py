"""fastgen-serve --peer ctranslate2 (the serving benchmark's peer): the server's fixed batches decoded by
CTranslate2, and each answer is CTranslate2's own translation of that sentence (its greedy search on the same
converted checkpoint, called here directly)."""

import json
from pathlib import Path

import pytest

from tests.serve.servers import Server
from tests.serve.test_app import answers_then_stop

ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is not installed")


@pytest.mark.parametrize("precision, compute_type", [((), "default"), (("--quantize", "int8"), "int8")])
def test_ctranslate2_behind_the_server_answers_its_own_translations(toy_model, plugin_dir, tmp_path, sources, precision,
                                                                    compute_type):
    from fairseq.data import Dictionary

    from fairseq_fastgen.ctranslate2_model import convert

    source_words = Dictionary.load(str(Path(toy_model.data_bin) / "dict.en.txt"))
    known = [s for s in sources if all(source_words.index(w) != source_words.unk() for w in s.split())]
    assert len(known) >= 16
    translator = ctranslate2.Translator(str(convert(ctranslate2, str(toy_model.checkpoint), str(toy_model.data_bin),
                                                    "en", "fr")), device="cpu", intra_threads=1,
                                       compute_type=compute_type)
    from fairseq import checkpoint_utils

    positions = checkpoint_utils.load_checkpoint_to_cpu(str(toy_model.checkpoint))["cfg"].model.max_target_positions
    expected = {s: " ".join(r.hypotheses[0]) for s, r in zip(known, translator.translate_batch(
        [s.split() for s in known], beam_size=1, max_decoding_length=positions - 1))}  # fairseq's cap, as the server

    server = Server(toy_model, plugin_dir, tmp_path, "--decoder", "greedy", "--beam", "1", "--batching", "fixed",
                    "--fixed-batch-size", "8", "--peer", "ctranslate2", *precision)
    answers, status = answers_then_stop(server, known, 700)
    assert status == 0, server.log()[-3000:]
    assert len(answers) == 8 * 3
    for sentences, status, body in answers:
        assert status == 200, body
        translations = json.loads(body)["translations"]
        assert [t["text"] for t in translations] == [expected[s] for s in sentences]
        assert [t["tokens"] for t in translations] == [expected[s] for s in sentences]
