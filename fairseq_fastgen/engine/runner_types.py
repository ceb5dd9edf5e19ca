"""What a decoder may ask of a runner, as types: every engine's :class:`Runner`, and what only some offer.

A decoder holds a runner and never the model; it does not know which engine the runner is.  Every engine
(``fairseq_runner.ModelRunner``, ``runners.StaticRunner``, ``compiled.CompiledRunner``) is a :class:`Runner`.
The step engines' caches also let a refill's rows take finished rows' places (:class:`PlacesRows`); a decoder
asks ``isinstance(runner, PlacesRows)``, not a flag.  Decoders change rows' layout by plans (``row_plans.py``)
that the runner carries out (``carry_out``).  Shapes: ``rows`` decoded rows, ``n`` new positions of a
row, ``src_len`` source positions, ``dim`` the decoder's width.
"""

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Runner(Protocol):
    """Every engine: the model's facts, its encoder, its steps and its cache, which decoders hand back unread."""

    max_target_positions: int  # target positions the decoder has
    identity_first_head: bool  # a k-head model whose head 1 is the base output

    # the encoder
    def encode(self, net_input): ...  # fairseq's encoder-output dict, (src_len, rows, dim) states
    def reorder_encoder_out(self, encoder_out, index: Tensor): ...  # index (rows,)
    def concat_encoder_out(self, encoder_outs): ...  # several groups of rows, sources left-padded to the widest

    # the cache
    def new_cache(self, capacity: int = 0): ...  # capacity: target positions, bos included
    def reorder_cache(self, cache, index: Tensor) -> None: ...  # index (rows,)
    def surviving_rows(self, finished: Tensor) -> Tensor: ...  # finished (rows,) bool -> kept rows, engine's order
    def copied_cache(self, cache): ...  # one that reorders without touching ``cache``
    def concat_caches(self, caches): ...
    def widen_cache(self, cache, src_len: int, extra: int) -> None: ...  # ``extra`` masked source positions
    def keep_accepted(self, cache, accepted: Tensor) -> None: ...  # accepted (rows, n): a prefix of each row
    def drop_last_positions(self, cache, dropped: int) -> None: ...

    # a scheduler's layout plans (row_plans.py: KeepRows, WidenSources, ...), by the operations above
    def carry_out(self, plan, encoder_out, cache): ...  # -> encoder_out; the cache changed in place
    def merged_rows(self, encoder_outs, caches): ...  # -> (encoder_out, cache) of several groups' rows

    # the steps
    def step(self, tokens: Tensor, encoder_out, cache): ...  # tokens (rows, length) -> lprobs (rows, vocab), attn
    def step_rows(self, last_tokens: Tensor, positions: Tensor, encoder_out, cache): ...  # (rows, 1), (rows,)
    def step_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache): ...  # (rows, n) -> features
    def step_block_scored(self, tokens: Tensor, positions: Tensor, encoder_out, cache): ...  # and their lprobs
    def project(self, features: Tensor, project=None, normalize: bool = True) -> Tensor: ...  # (rows, n, vocab)
    def lprobs(self, features: Tensor) -> Tensor: ...  # (rows, 1, dim) -> (rows, vocab)

    # a k-head model (blockwise decoding)
    def heads(self, features: Tensor, block_size: int) -> Tensor: ...  # (..., dim) -> (..., block, dim)
    def int8_proposals(self, tokens=None): ...  # int8 copies of the weights of heads 2..k's proposals
    def int8_later_heads(self, features: Tensor, proposer) -> Tensor: ...  # (rows, dim) -> (rows, k - 1, dim)


@runtime_checkable
class PlacesRows(Protocol):
    """The step engines' caches (``static``, ``compiled``): a refill's rows take finished rows' places, rows of
    any lengths side by side, the encoder-decoder keys computed once per sentence and sources narrowed."""

    def start_cache(self, cache, encoder_out) -> None: ...  # the rows' encoder-decoder keys/values, once
    def place_rows(self, cache, slots: Tensor, fresh, rows: Tensor) -> None: ...  # fresh's rows into slots
    def release_rows(self, cache, rows: Tensor) -> None: ...  # finished rows: no longer attended
    def drop_leading_padding(self, cache) -> None: ...  # positions only released rows attended
    def narrow_cache(self, cache, width: int) -> None: ...  # the first ``width`` source positions kept
