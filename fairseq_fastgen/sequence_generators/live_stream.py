"""A stream that outlives ``generate()`` calls: fairseq-interactive's lines enter it as they arrive.

In fairseq-interactive a streaming decoder (``greedy-stream``, ``blockwise-stream``, ``var-stream``,
``fixed-stream``) keeps one :class:`LiveStream`.  Stock's loop still reads a line, batches it, calls
``generate`` and prints the answer; here each ``generate`` call adds its sentences to the stream (unless the
stream already took them in) and iterates the stream until they are finished, and whenever a refill finds
no source waiting, the stream asks ``arrivals()`` for the lines read meanwhile (tokenized as stock does, see
``fairseq_fastgen/cli/live_lines.py``).  Sentences of later lines thus decode in the same model calls as the
line being answered, and an answer is printed as soon as it and every earlier one are done.

The pool only grows: a sentence's source stays (its results are dropped once returned).
"""

from collections import deque
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from fairseq_fastgen.sequence_generators.generator import DecodeContext, SourcePool
from fairseq_fastgen.sequence_generators.processors import build_processors, row_max_len
from fairseq_fastgen.sequence_generators.streaming import StreamRun

RETURNED: list = []  # a sentence's results once handed to its generate() call


class LivePool(SourcePool):
    """A :class:`SourcePool` that grows: ``pull()`` appends the sentences that arrived (non-blocking)."""

    def __init__(self, pad: int, left_pad: bool, max_len_of: Callable, arrivals: Callable, admitted: Callable,
                 device):
        empty = torch.empty((0, 0), dtype=torch.long, device=device)
        lengths = torch.empty(0, dtype=torch.long, device=device)
        super().__init__({"src_tokens": empty, "src_lengths": lengths}, lengths, lengths, None, pad)
        self.left_pad = left_pad
        self.max_len_of = max_len_of  # (sentences,) real source lengths -> (sentences,) hypothesis length limits
        self.arrivals = arrivals  # () -> list of net_input dicts, the lines read since the last call
        self.on_admitted = admitted  # (count) -> None: sources that entered the decoding
        self.ahead = deque()  # (first sentence, count, src_tokens) pulled before their generate() call
        self.results: List = []  # the DecodeContext's results, grown with the pool

    def extend(self, net_input: Dict[str, torch.Tensor]) -> range:
        """Append a batch's sentences; returns their positions in the pool."""
        first = self.size
        tokens = net_input["src_tokens"].to(self.src_lengths.device)  # (batch, width)
        width = max(tokens.size(1), self.net_input["src_tokens"].size(1))
        src_tokens = torch.cat([self._padded(self.net_input["src_tokens"], width), self._padded(tokens, width)])
        src_lengths = torch.cat([self.net_input["src_lengths"], net_input["src_lengths"].to(tokens.device)])
        self.net_input = {"src_tokens": src_tokens, "src_lengths": src_lengths}
        real = (tokens.ne(self.pad) & tokens.ne(self.eos)).long().sum(dim=1)  # (batch,) without pad and eos
        self.src_lengths = torch.cat([self.src_lengths, real])
        self.max_len = torch.cat([self.max_len, self.max_len_of(real)])
        self.results.extend([None] * tokens.size(0))
        return range(first, self.size)

    def pull(self) -> int:
        """Append the sentences that arrived; how many."""
        added = 0
        for net_input in self.arrivals():
            sentences = self.extend(net_input)
            self.ahead.append((sentences, net_input["src_tokens"]))
            added += len(sentences)
        return added

    def admitted(self, count: int):
        self.on_admitted(count)

    def _padded(self, tokens, width):
        extra = width - tokens.size(1)
        return F.pad(tokens, (extra, 0) if self.left_pad else (0, extra), value=self.pad) if extra else tokens


class LiveStream:
    """The stream of one generator over a live pool (see the module doc)."""

    def __init__(self, generator, arrivals: Callable, admitted: Callable, left_pad: bool = True, device="cpu"):
        max_positions = generator.model.max_decoder_positions()
        self.pool = LivePool(generator.pad, left_pad, lambda real: row_max_len(real, generator.gen_cfg, max_positions),
                             arrivals, admitted, device)
        self.pool.eos = generator.eos
        self.ctx = DecodeContext(
            generator.runner, build_processors(generator.tgt_dict, generator.gen_cfg), self.pool, generator.eos,
            generator.gen_cfg.lenpen, not generator.gen_cfg.unnormalized, generator.nbest, generator.counters,
        )
        self.ctx.results = self.pool.results
        self.run = StreamRun(generator.scheduler, generator.policy, self.ctx)

    def answer(self, net_input) -> List[List[Dict[str, torch.Tensor]]]:
        """The hypotheses of a batch's sentences: the stream decodes until each is finished."""
        sentences = self._sentences_of(net_input)
        results = self.pool.results
        for sentence in sentences:
            while results[sentence] is None:
                if not self.run.iterate():
                    raise RuntimeError(f"the live stream lost sentence {sentence} (a bug: please report)")
        answers = [results[sentence] for sentence in sentences]
        for sentence in sentences:
            results[sentence] = RETURNED
        return answers

    def _sentences_of(self, net_input) -> range:
        """The pool positions of a batch: taken in ahead of this call (then the first such batch), or now."""
        if not self.pool.ahead:
            return self.pool.extend(net_input)
        sentences, src_tokens = self.pool.ahead.popleft()
        if not torch.equal(src_tokens.to(net_input["src_tokens"].device), net_input["src_tokens"]):
            raise RuntimeError("the live stream was asked for another batch than the one it read ahead "
                               "(a bug: please report)")
        return sentences
