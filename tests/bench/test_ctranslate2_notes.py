"""fastgen-bench and CTranslate2: the note on CTranslate2 measured beside torch's threads in the bench's own process,
and the compute type it runs in."""

from pathlib import Path

from fairseq_fastgen.bench.ctranslate2_peer import shared_threads_note

REPO = Path(__file__).resolve().parents[2]


def test_a_cpu_run_with_more_than_one_thread_says_ctranslate2_shares_the_process():
    note = shared_threads_note(2, use_cuda=False)
    assert "torch's 2 threads" in note
    script = note.split("compare with ")[1].split(",")[0]
    assert (REPO / script).is_file()  # the script the note sends the user to exists


def test_one_thread_and_cuda_runs_carry_no_such_note():
    assert shared_threads_note(1, use_cuda=False) is None
    assert shared_threads_note(4, use_cuda=True) is None


def test_ctranslate2_computes_in_the_precision_of_the_decoders():
    from types import SimpleNamespace

    from fairseq_fastgen.bench.ctranslate2_peer import matching_compute_type

    def cfg(quantize=None, fp16=False):
        return SimpleNamespace(generation=SimpleNamespace(quantize=quantize), common=SimpleNamespace(fp16=fp16))

    assert matching_compute_type(cfg("int8")) == "int8"
    assert matching_compute_type(cfg("bf16")) == "bfloat16"
    assert matching_compute_type(cfg(fp16=True)) == "float16"
    assert matching_compute_type(cfg()) == "default"
