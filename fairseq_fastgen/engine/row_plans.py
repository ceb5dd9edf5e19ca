"""What a scheduler decides about its rows' layout, as plans a runner carries out (``runner.carry_out``).

A decoding state or a streaming scheduler decides which rows stay, which of a refill's rows enter which finished
rows' places and how wide the sources are; the runner carries that out on the encoder output and its own cache
with the operations of its engine.  Shapes: ``rows`` the decoded rows, ``n`` the rows a plan moves, ``src_len``
the source positions of every row.
"""

from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass(frozen=True)
class KeepRows:
    """The rows ``index`` stay, in its order (a row may repeat: a beam's copies); the others leave."""

    index: Tensor  # (kept,) long, rows of the encoder output and cache


@dataclass(frozen=True)
class PlaceRows:
    """Fresh rows (a refill's, started ahead with their group) take finished rows' places, of the same source
    width; the running rows stay where they are.  Only the step engines' caches take rows in place."""

    slots: Tensor  # (n,) long: rows of the running encoder output and cache (finished ones) taken over
    fresh_encoder_out: dict  # fairseq's encoder-output dict of the fresh rows' group, (src_len, group, dim)
    fresh_cache: object  # the group's cache, started
    rows: Tensor  # (n,) long: the group's rows entering ``slots``


@dataclass(frozen=True)
class ReleaseRows:
    """Finished rows that stay, as padding rows, until a refill's rows take their places are no longer attended,
    and the leading positions no row attends any more are dropped (all of them there where the finished rows
    left already, ``KeepRows``: ``rows`` None).  Step engines only."""

    rows: Optional[Tensor] = None  # (released,) long; None: none released now


@dataclass(frozen=True)
class WidenSources:
    """Every row's source right-padded from ``src_len`` by ``extra`` masked positions (cohorts merged, a refill
    joining wider sources)."""

    src_len: int  # source positions now
    extra: int  # positions added after them: (src_len + extra) in all


@dataclass(frozen=True)
class NarrowSources:
    """The first ``width`` source positions kept, the ones after them padding for every row (the longest
    sources of a stream whose sources are left-justified finished).  Step engines only."""

    width: int  # source positions kept


@dataclass(frozen=True)
class LeftJustifySources:
    """Each row's source positions first and its padding after them (fairseq left-pads sources), before the
    cache holds the rows' encoder-decoder keys: the layout in which ``NarrowSources`` can drop positions."""
