"""``--no-repeat-ngram-size`` for stock fairseq beam search, with the plugin's op.

fairseq's ``NGramRepeatBlock`` runs its CUDA extension when built and otherwise
a Python fallback that, since fairseq commit 8ca48131, compares the padded tail
of the token buffer and so bans nothing.  ``fairseq-fixed``
never builds the extension, so stock banning does nothing on CPU or GPU.
:func:`use_fastgen_ngram_blocking` gives a stock generator a drop-in
replacement that calls :func:`fairseq_fastgen.ops.ngram_ban.ban_repeated_ngrams`
(vectorized torch on CPU, the CuPy kernel on CUDA), with the semantics fairseq's
CUDA extension has: an n-gram of the generated tokens (bos included) may occur
only once per hypothesis.

There is deliberately no option to go back to the stock blocker: in this
fairseq it bans nothing, so it can serve neither as a baseline nor for
bisecting (``--no-repeat-ngram-size 0`` gives the same output).
"""

import torch
from torch import nn

from fairseq_fastgen.ops.ngram_ban import ban_repeated_ngrams


class RepeatedNgramBlocker(nn.Module):
    """Same call as fairseq's NGramRepeatBlock: ``(tokens, lprobs, bsz, beam_size, step) -> lprobs``.

    tokens: (bsz * beam_size, max_len + 2), the generator's token buffer; only
        ``tokens[:, :step + 1]`` is generated so far.
    lprobs: (bsz * beam_size, vocab), edited in place.
    """

    def __init__(self, no_repeat_ngram_size: int, stock_blocker=None):
        super().__init__()
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.stock_blocker = [stock_blocker]  # the generator's own (in a list: not a submodule of this one)

    def forward(self, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int, step: int) -> torch.Tensor:
        return ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)


def use_fastgen_ngram_blocking(generator) -> bool:
    """Replace the n-gram blocker of a stock SequenceGenerator; returns whether it had one."""
    stock_blocker = getattr(generator, "repeat_ngram_blocker", None)
    if stock_blocker is None:
        return False
    if not isinstance(stock_blocker, RepeatedNgramBlocker):
        generator.repeat_ngram_blocker = RepeatedNgramBlocker(stock_blocker.no_repeat_ngram_size, stock_blocker)
    return True


def restore_ngram_blocking(generator) -> bool:
    """Undo :func:`use_fastgen_ngram_blocking`: the generator's own blocker again; returns whether it had ours."""
    blocker = getattr(generator, "repeat_ngram_blocker", None)
    if not isinstance(blocker, RepeatedNgramBlocker):
        return False
    generator.repeat_ngram_blocker = blocker.stock_blocker[0]
    return True
