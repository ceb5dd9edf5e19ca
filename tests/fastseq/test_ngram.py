"""--no-repeat-ngram-size through stock fairseq beam search with the plugin's op."""

import os
import subprocess

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.ngram_repeat_block import NGramRepeatBlock

from fairseq_fastgen.fastseq import RepeatedNgramBlocker, optimize_stock_generator
from fairseq_fastgen.options import parse_options
from fastgen_demo import toy

pytestmark = pytest.mark.xdist_group("test_ngram")


def banned_by_python(tokens, step, n):
    """{(row, token)} that would repeat an n-gram of tokens[row, :step + 1]."""
    banned = set()
    for row, sequence in enumerate(tokens[:, : step + 1].tolist()):
        suffix = sequence[len(sequence) - n + 1:] if n > 1 else []
        for start in range(len(sequence) - n + 1):
            if sequence[start: start + n - 1] == suffix:
                banned.add((row, sequence[start + n - 1]))
    return banned


@pytest.mark.parametrize("n", [1, 2, 3])
def test_blocker_has_fairseqs_call_and_bans_repeats(n):
    bsz, beam_size, vocab, max_len = 3, 4, 7, 12
    generator = torch.Generator().manual_seed(n)
    generated = torch.randint(4, vocab, (bsz * beam_size, max_len + 2), generator=generator)  # (rows, max_len + 2)
    generated[:, 0] = 2  # bos = eos, as SequenceGenerator fills it
    blocker = RepeatedNgramBlocker(n)
    for step in range(max_len):
        tokens = generated.clone()
        tokens[:, step + 1:] = 1  # the buffer's unwritten tail is padding
        lprobs = torch.zeros(bsz * beam_size, vocab)
        returned = blocker(tokens, lprobs, bsz, beam_size, step)
        assert returned is lprobs
        got = {tuple(cell) for cell in (lprobs == float("-inf")).nonzero().tolist()}
        assert got == banned_by_python(tokens, step, n)


def test_generator_gets_the_plugins_blocker(loaded_toy):
    config = GenerationConfig(beam=4, no_repeat_ngram_size=3)
    generator = loaded_toy.task.build_generator(loaded_toy.models, config)
    optimize_stock_generator(generator, parse_options(config).common)
    assert isinstance(generator.repeat_ngram_blocker, RepeatedNgramBlocker)
    assert generator.repeat_ngram_blocker.no_repeat_ngram_size == 3
    without = GenerationConfig(beam=4)
    assert optimize_stock_generator(loaded_toy.task.build_generator(loaded_toy.models, without),
                                    parse_options(without).common) \
        .repeat_ngram_blocker is None


def generate(toy_model, *args, plugin=True):
    program = toy.fairseq_command("generate") if plugin else toy.stock_fairseq_command("generate")
    cmd = program + [str(toy_model.data_bin), "--path", str(toy_model.checkpoint), "--cpu",
                     "--batch-size", "64", "--required-batch-size-multiple", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the test machines' cores are shared
    if plugin:
        cmd += ["--user-dir", toy.PLUGIN_DIR]
    completed = subprocess.run(cmd + list(args), capture_output=True, text=True, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout


def hypotheses_with_repeated_bigram(output):
    """Sentence ids whose hypothesis, after bos, repeats a bigram; and the number of hypotheses."""
    repeated, count = [], 0
    for line in output.splitlines():
        if not line.startswith("H-"):
            continue
        sentence, _, text = line.split("\t")
        words = ["</s>"] + text.split()
        bigrams = list(zip(words, words[1:]))
        count += 1
        if len(set(bigrams)) != len(bigrams):
            repeated.append(sentence)
    return repeated, count


def test_stock_cpu_blocker_misses_a_repeat_that_ours_bans():
    """fairseq issue 5206, on the buffer shape SequenceGenerator passes: (rows, max_len + 2), padded tail."""
    tokens = torch.tensor([[2, 5, 6, 5, 1, 1, 1]])  # bos, then "5 6 5": banning 6 avoids repeating "5 6"
    stock_lprobs, our_lprobs = torch.zeros(1, 8), torch.zeros(1, 8)
    NGramRepeatBlock(2, use_extension=False)(tokens, stock_lprobs, 1, 1, 3)
    RepeatedNgramBlocker(2)(tokens, our_lprobs, 1, 1, 3)
    assert not torch.isinf(stock_lprobs).any()
    assert torch.isinf(our_lprobs).nonzero().tolist() == [[0, 6]]


@pytest.mark.parametrize("decoding", [["--beam", "4"], ["--beam", "1"], ["--decoder", "greedy", "--beam", "1"]])
def test_no_hypothesis_repeats_a_bigram(toy_model, decoding):
    repeated, count = hypotheses_with_repeated_bigram(generate(toy_model, *decoding, "--no-repeat-ngram-size", "2"))
    assert count == 200
    assert repeated == []
