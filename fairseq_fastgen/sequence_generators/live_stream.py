"""A stream that outlives ``generate()`` calls: fairseq-interactive's lines enter it as they arrive.

In fairseq-interactive a streaming decoder (``greedy-stream``, ``blockwise-stream``, ``var-stream``,
``fixed-stream``) keeps one :class:`LiveStream`.  Stock's loop still reads a line, batches it, calls
``generate`` and prints the answer; here each ``generate`` call adds its sentences to the stream (unless the
stream already took them in) and iterates the stream until they are finished; at every refill the stream
asks ``arrivals()`` for the lines read meanwhile (tokenized as stock does, see
``fairseq_fastgen/cli/live_lines.py``).  Sentences of later lines thus decode in the same model calls as the
line being answered, and an answer is printed as soon as it and every earlier one are done.

The pool keeps a sentence's source tokens until it enters the decoding and its hypotheses until they are
returned; a long session grows by a few dozen bytes a line (its lengths and an empty results slot).
"""

from collections import deque
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from fairseq_fastgen.sequence_generators.generator import DecodeContext
from fairseq_fastgen.sequence_generators.processors import build_processors, row_max_len
from fairseq_fastgen.sequence_generators.streaming import PADDING_SENTENCE, StreamRun, finished_rows_wait, select_padded

RETURNED: list = []  # a sentence's results once handed to its generate() call


class GrowingVector:
    """A 1-D tensor that grows at its end, doubling its storage (appends cost O(1) amortized)."""

    def __init__(self, dtype, device):
        self.storage = torch.empty(16, dtype=dtype, device=device)
        self.count = 0

    @property
    def values(self) -> torch.Tensor:
        return self.storage[: self.count]  # (count,)

    def append(self, values: torch.Tensor):
        needed = self.count + values.numel()
        if needed > self.storage.numel():
            self.storage = F.pad(self.storage, (0, max(needed, 2 * self.storage.numel()) - self.storage.numel()))
        self.storage[self.count : needed] = values
        self.count = needed


class LivePool:
    """The sentences of a live stream, addressed by their position in it as a :class:`SourcePool`'s are.
    ``pull()`` appends the sentences that arrived (it never waits).  A sentence's source tokens are kept
    until it enters the decoding; per sentence the pool then keeps three lengths and its results slot (empty
    once returned), so a long session grows by a few dozen bytes a line."""

    prefix_tokens = None

    def __init__(self, pad: int, eos: int, left_pad: bool, max_len_of: Callable, arrivals: Callable,
                 admitted: Callable, device):
        self.pad, self.eos, self.left_pad, self.device = pad, eos, left_pad, device
        self.max_len_of = max_len_of  # (sentences,) source widths, eos included -> (sentences,) length limits
        self.arrivals = arrivals  # () -> list of net_input dicts, the lines read since the last call
        self.on_admitted = admitted  # (count) -> None: sources that entered the decoding
        self.tokens: List = []  # per sentence: its source tokens with eos, (length,), None once admitted
        self.lengths = {name: GrowingVector(torch.long, device) for name in ("source_len", "src_lengths", "max_len")}
        self.admitted_count = 0  # sentences before it entered the decoding
        self.ahead = deque()  # (sentences, src_tokens) pulled before their generate() call
        self.results: List = []  # the DecodeContext's results, grown with the pool

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def source_len(self) -> torch.Tensor:
        return self.lengths["source_len"].values  # (sentences,) tokens with eos

    @property
    def src_lengths(self) -> torch.Tensor:
        return self.lengths["src_lengths"].values  # (sentences,) without pad and eos

    @property
    def max_len(self) -> torch.Tensor:
        return self.lengths["max_len"].values  # (sentences,) length limit of each hypothesis

    def extend(self, net_input: Dict[str, torch.Tensor]) -> range:
        """Append a batch's sentences; returns their positions in the pool."""
        first = self.size
        tokens = net_input["src_tokens"].to(self.device)  # (batch, width)
        kept = tokens.ne(self.pad)  # (batch, width)
        self.tokens += [row[keep] for row, keep in zip(tokens, kept)]
        source_len = kept.sum(dim=1)  # (batch,)
        real = source_len - tokens.eq(self.eos).sum(dim=1)  # (batch,) without eos
        limits = self.max_len_of(source_len)  # (batch,)
        for name, values in (("source_len", source_len), ("src_lengths", real), ("max_len", limits)):
            self.lengths[name].append(values)
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

    def subset(self, index: torch.Tensor) -> Dict[str, torch.Tensor]:
        """net_input of the given sentences, padded to their own longest source."""
        rows = [self.tokens[sentence] for sentence in index.tolist()]
        width = max(row.numel() for row in rows)
        src_tokens = torch.stack([F.pad(row, (width - row.numel(), 0) if self.left_pad else (0, width - row.numel()),
                                        value=self.pad) for row in rows])  # (sentences, width)
        return {"src_tokens": src_tokens, "src_lengths": self.source_len.index_select(0, index)}

    inputs_of = subset

    def admitted(self, count: int):
        """The next ``count`` sentences entered the decoding: their source tokens are not read again."""
        for sentence in range(self.admitted_count, self.admitted_count + count):
            self.tokens[sentence] = None
        self.admitted_count += count
        self.on_admitted(count)


class LiveStream:
    """The stream of one generator over a live pool (see the module doc)."""

    def __init__(self, generator, arrivals: Callable, admitted: Callable, left_pad: bool = True, device="cpu"):
        max_positions = generator.model.max_decoder_positions()
        self.pool = LivePool(generator.pad, generator.eos, left_pad,
                             lambda widths: row_max_len(widths, generator.gen_cfg, max_positions), arrivals, admitted,
                             device)
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

    # ---- a caller that reads the results itself (fastgen-serve: fairseq_fastgen/serve/batching.py) ----
    @property
    def rows(self) -> int:
        """Rows of the running states, padding rows included: what each model call computes."""
        return sum(state.rows for state in self.run.states)

    def cancel(self, sentences) -> List[int]:
        """The rows of ``sentences`` (pool positions) leave the stream unanswered (their client gave up); returns
        the sentences found running (one not admitted yet is not: cancel it again once it is).  A policy whose
        refills take finished rows' places keeps their rows as waiting padding rows, as a finished row
        (``finished_rows_wait``); a policy of padded cohorts keeps its other rows, padded again (``select_padded``)."""
        wanted = torch.as_tensor(sorted(sentences), dtype=torch.long)  # (n,)
        found = set()
        for cohort in self.run.states:
            gone = torch.isin(cohort.sentence, wanted.to(cohort.sentence.device))  # (rows,)
            if not bool(gone.any()):
                continue
            found.update(cohort.sentence[gone].tolist())
            if self.run.joins_lengths:
                finished_rows_wait(cohort, gone)
            else:
                select_padded(cohort, (~gone & cohort.sentence.ne(PADDING_SENTENCE)).nonzero().squeeze(1))
        self.run.forget_empty()
        forget = getattr(self.run.policy, "forget", None)  # a beam search's hypotheses of those sentences
        if forget is not None and found:
            forget(sorted(found), self.ctx)
        return sorted(found)

    def decided_tokens(self, sentences) -> Dict[int, torch.Tensor]:
        """For decoders with one row per sentence (greedy, blockwise and their streams): the tokens each of
        ``sentences`` (a set of pool positions) running in the stream has so far, (length,) each; those are
        its answer's first tokens."""
        decided = {}
        for cohort in self.run.states:
            for row, sentence in enumerate(cohort.sentence.tolist()):
                if sentence in sentences and sentence not in decided:
                    decided[sentence] = cohort.tokens[row, 1: 1 + cohort.row_length(row)].clone()
        return decided

    def _sentences_of(self, net_input) -> range:
        """The pool positions of a batch: taken in ahead of this call (then the first such batch), or now."""
        if not self.pool.ahead:
            return self.pool.extend(net_input)
        sentences, src_tokens = self.pool.ahead.popleft()
        if not torch.equal(src_tokens.to(net_input["src_tokens"].device), net_input["src_tokens"]):
            raise RuntimeError("the live stream was asked for another batch than the one it read ahead "
                               "(a bug: please report)")
        return sentences
