"""The engine's incremental state: every layer's keys/values in preallocated buffers.

Only the engine's runners read or write it; decoders hold it in their
``DecodingState`` and hand it back to the runner.
"""

import copy
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


IN_PLACE_SHARE = 4  # select in place while at most a quarter of the kept rows move


class StaticCache:
    def __init__(self, capacity: int, zeroed: bool = False):
        self.capacity = capacity  # target positions each row's buffers hold
        # zeroed: unwritten positions hold zeros, kept so by every change of the cache (the padded step reads them,
        # masked); else they are never read. zero_unwritten() turns it on, for a cache about to take a padded step
        self.zeroed = zeroed
        self.length = 0  # positions written (every row of a cache is at the same length)
        self.real_rows = 0  # rows of the state; the compiled engine pads the buffers' rows beyond them
        self.self_keys: List[Tensor] = []  # per layer (rows, heads, capacity, head_dim)
        self.self_values: List[Tensor] = []
        self.cross_keys: List[Tensor] = []  # per layer (rows, heads, src_len, head_dim)
        self.cross_values: List[Tensor] = []
        self.cross_mask: Optional[Tensor] = None  # (rows, src_len) True at source padding
        # (rows, capacity) True at target positions a row does not attend: the left padding of rows that kept
        # fewer positions than others (keep_accepted); None while every written position is attended
        self.self_padding: Optional[Tensor] = None
        # (rows,) which row of the first step each row's encoder-decoder keys/values are a copy of: a reorder
        # that gives every row the same origin again (beams changing places within their sentences) leaves
        # them where they are instead of copying the largest buffers of the cache
        self.cross_origin: Optional[Tensor] = None
        # beams > 1: the rows are sentences x beams (each sentence's beams together, as fairseq's beam search
        # keeps them) and the encoder-decoder keys/values and mask hold one entry per sentence
        self.beams = 1
        # False while another cache holds these buffers (``copy``): a reorder then replaces them, never writes
        self.owns_buffers = True

    @property
    def started(self) -> bool:
        return bool(self.cross_keys)

    def start(self, cross_keys, cross_values, cross_mask, heads: int, head_dim: int, origin: Optional[Tensor] = None,
              beams: int = 1):
        """Take the encoder-decoder keys/values of every row (with ``beams`` > 1: of every sentence, each
        shared by its ``beams`` rows) and allocate the self-attention buffers; ``origin`` (rows,): equal for
        rows whose keys/values are equal (``row_origins``), else every row its own."""
        rows, first = cross_keys[0].size(0) * beams, cross_keys[0]
        self.cross_keys, self.cross_values, self.cross_mask = list(cross_keys), list(cross_values), cross_mask
        self.beams, self.real_rows = beams, rows
        self.cross_origin = torch.arange(rows, device=first.device) if origin is None else origin
        shape = (rows, heads, self.capacity, head_dim)
        allocate = first.new_zeros if self.zeroed else first.new_empty
        self.self_keys = [allocate(shape) for _ in cross_keys]
        self.self_values = [allocate(shape) for _ in cross_keys]

    @staticmethod
    def row_origins(encoder_states: Tensor, mask: Optional[Tensor]) -> Tensor:
        """(rows,) the first of each run of neighbouring rows with equal encoder states (src_len, rows, dim)
        and padding masks (rows, src_len): the copies of a sentence's encoder output that a beam search
        made for its beams.  Their keys/values are equal, so a reorder of beams within their sentences
        leaves the encoder-decoder buffers where they are."""
        same = encoder_states[:, 1:].eq(encoder_states[:, :-1]).all(dim=2).all(dim=0)  # (rows - 1,)
        if mask is not None:
            same &= mask[1:].eq(mask[:-1]).all(dim=1)
        rows = torch.arange(encoder_states.size(1), device=encoder_states.device)
        first = torch.cat([same.new_ones(1), ~same])  # (rows,) a run starts here
        return torch.cummax(torch.where(first, rows, 0), dim=0).values

    def copy(self) -> "StaticCache":
        """A cache that shares this one's buffers and reorders or grows without touching it (both replace
        buffers, never write into them)."""
        copied = copy.copy(self)
        for name in ("self_keys", "self_values", "cross_keys", "cross_values"):
            setattr(copied, name, list(getattr(self, name)))
        self.owns_buffers = copied.owns_buffers = False
        return copied

    def ensure_room(self, positions: int, doubling: bool = True):
        """Grow the buffers so that ``positions`` positions fit: to at least double their capacity, or
        (``doubling`` off) to exactly ``positions``."""
        if positions <= self.capacity or not self.started:
            self.capacity = max(self.capacity, positions)
            return
        capacity = max(positions, 2 * self.capacity) if doubling else positions
        for buffers in (self.self_keys, self.self_values):  # one layer at a time: one transient copy at most
            for layer, buffer in enumerate(buffers):
                buffers[layer] = F.pad(buffer, (0, 0, 0, capacity - self.capacity))
        if self.self_padding is not None:
            self.self_padding = F.pad(self.self_padding, (0, capacity - self.capacity))
        self.capacity = capacity

    def shrink_room(self, positions: int):
        """Keep room for ``positions`` positions only (the written ones at least): a stream whose first positions
        went (``drop_leading_padding``) leaves its buffers longer than its rows need, and the padded step reads
        every position of them."""
        capacity = max(positions, self.length, 1)
        if capacity >= self.capacity or not self.started:
            return
        self.self_keys = [b[:, :, :capacity].contiguous() for b in self.self_keys]  # (rows, heads, capacity, hd)
        self.self_values = [b[:, :, :capacity].contiguous() for b in self.self_values]
        if self.self_padding is not None:
            self.self_padding = self.self_padding[:, :capacity].contiguous()
        self.capacity = capacity

    def zero_unwritten(self):
        """Zero the unwritten positions (once) and keep them zero from now on."""
        if not self.zeroed:
            for buffer in self.self_keys + self.self_values:
                buffer[:, :, self.length:] = 0
            self.zeroed = True

    def attended_padding(self, new: int) -> Optional[Tensor]:
        """The padding (rows, length + new) of the positions a step writing ``new`` positions attends to
        (the new ones are never padding), or None when no row has any."""
        if self.self_padding is None:
            return None
        self.self_padding[:, self.length: self.length + new] = False
        return self.self_padding[:, : self.length + new]

    def attended(self) -> Tensor:
        """(rows, capacity) True at the written positions each row attends (not its padding)."""
        written = torch.arange(self.capacity, device=self.self_keys[0].device) < self.length  # (capacity,)
        if self.self_padding is None:
            return written.expand(self.self_keys[0].size(0), -1).contiguous()
        return written & ~self.self_padding[:, : self.capacity]

    # ---- positions (blockwise verification) ----------------------------------------------------
    def drop_last(self, dropped: int):
        """Forget the last ``dropped`` positions of every row."""
        self.length -= dropped
        if self.zeroed and dropped:
            for buffer in self.self_keys + self.self_values:
                buffer[:, :, self.length: self.length + dropped] = 0

    def keep_accepted(self, accepted: Tensor):
        """Of the ``n`` positions last written, keep those where ``accepted`` (rows, n; a prefix of each row)
        holds, as fairseq's ``KHeadTransformerDecoder.rollback`` keeps them in its cache: when rows keep
        different numbers, each row's positions move, in order, to the right end of the first ``width``
        positions (the longest row's), and the positions left of them become padding."""
        counts = accepted.sum(dim=1)  # (rows,)
        if bool(counts.eq(counts[0]).all()):
            self.drop_last(accepted.size(1) - int(counts[0]))
            return
        rows, length = accepted.size(0), self.length
        if self.self_padding is None:
            keep = accepted.new_ones((rows, length), dtype=torch.bool)  # (rows, length)
            self.self_padding = accepted.new_zeros((rows, self.capacity), dtype=torch.bool)
        else:
            keep = ~self.self_padding[:, :length]
        keep[:, length - accepted.size(1):] &= accepted
        width = int(keep.sum(dim=1).max())
        order = torch.sort(keep.int(), dim=1, stable=True).indices[:, -width:]  # (rows, width): padding first
        self.self_padding[:, :width] = ~keep.gather(1, order)
        heads, capacity, head_dim = self.self_keys[0].shape[1:]
        # the buffers seen as (rows * heads * capacity, head_dim): the line of each position kept, in its new order
        # (rows * heads * width,); one index_select of whole lines is faster than a gather along the positions
        lines = torch.arange(rows * heads, device=order.device).view(rows, heads, 1) * capacity
        lines = (lines + order.unsqueeze(1)).view(-1)
        for buffer in self.self_keys + self.self_values:  # (rows, heads, capacity, head_dim)
            moved = buffer.reshape(-1, head_dim).index_select(0, lines)
            buffer[:, :, :width] = moved.view(rows, heads, width, head_dim)
        self.drop_last(length - width)

    def drop_leading_padding(self, at_least: int = 16):
        """Drop the first positions where no row attends (rows that held them left), when there are at least
        ``at_least`` of them: the rest move left, so a stream whose rows keep joining does not attend to an
        ever longer cache."""
        if self.self_padding is None or self.length == 0:
            return
        attended = ~self.self_padding[:, : self.length].all(dim=0)  # (length,) some row attends the position
        first = int(attended.int().argmax()) if bool(attended.any()) else self.length
        if first < at_least:
            return
        kept = self.length - first
        for buffer in self.self_keys + self.self_values:  # (rows, heads, capacity, head_dim)
            buffer[:, :, :kept] = buffer[:, :, first : self.length].clone()
        self.self_padding[:, :kept] = self.self_padding[:, first : self.length].clone()
        self.self_padding[:, kept:] = False
        self.drop_last(first)

    # ---- rows -----------------------------------------------------------------------------------
    def select(self, index: Tensor, room: Optional[int] = None):
        """Keep (and reorder to) the rows ``index``; only the written positions are copied, one layer at a
        time (one transient copy at most).  ``room``: the buffers keep at most this many positions beyond
        the written ones, and get that many where none is left (a cache reordered at every step, as beam
        search's, then holds about what it wrote, as fairseq's does, and never grows apart from a reorder)."""
        capacity = self.capacity
        if room is not None:
            capacity = self.length + room if capacity <= self.length else min(capacity, self.length + room)
        moves = self._moves_in_place(index, capacity)  # (rows to fill, rows filling them), or None: a gather
        for buffers in (self.self_keys, self.self_values):
            for layer, buffer in enumerate(buffers):
                buffers[layer] = (self._select_written(buffer, index, capacity) if moves is None
                                  else self._move_rows(buffer, index.numel(), *moves))
        if self.self_padding is not None:
            padding = F.pad(self.self_padding, (0, max(capacity - self.capacity, 0)))
            self.self_padding = padding[:, :capacity].index_select(0, index)
        self.capacity = capacity
        self.real_rows = index.numel()
        if self.beams > 1:  # rows stay with their sentence's beams: the sentences kept, in order
            sentences = index.view(-1, self.beams)[:, 0] // self.beams
            if sentences.numel() != self.cross_keys[0].size(0) or not torch.equal(
                    sentences, torch.arange(sentences.numel(), device=sentences.device)):
                self.cross_keys = [b.index_select(0, sentences) for b in self.cross_keys]
                self.cross_values = [b.index_select(0, sentences) for b in self.cross_values]
                self.cross_mask = self.cross_mask.index_select(0, sentences)
            return
        origin = self.cross_origin.index_select(0, index)
        if torch.equal(origin, self.cross_origin):  # the same shape and origins: the same values in place
            return
        self.cross_origin = origin
        for buffers in (self.cross_keys, self.cross_values):
            for layer, buffer in enumerate(buffers):
                buffers[layer] = (buffer.index_select(0, index) if moves is None
                                  else self._move_rows(buffer, index.numel(), *moves))
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask.index_select(0, index)

    def _moves_in_place(self, index: Tensor, capacity: int) -> Optional[Tuple[Tensor, Tensor]]:
        """Where most rows of ``index`` keep their places (a runner's ``surviving_rows`` moves rows from the end
        into the places of finished ones), the rows to fill (moved,) and the rows filling them (moved,): only
        those are copied, within the buffers, which then narrow to the kept rows.  None (a gather of every row)
        with shared keys (beams), shared buffers (``copy``), more rows, another capacity, or more than a
        quarter of the rows moving (one gather copies them as fast)."""
        if (self.beams > 1 or not self.owns_buffers or not self.started or index.numel() > self.self_keys[0].size(0)
                or not capacity == self.capacity == self.self_keys[0].size(2)):
            return None
        moved = index.ne(torch.arange(index.numel(), device=index.device)).nonzero().squeeze(1)  # (moved,)
        if IN_PLACE_SHARE * moved.numel() > index.numel():
            return None
        return moved, index.index_select(0, moved)

    @staticmethod
    def _move_rows(buffer: Tensor, rows: int, moved: Tensor, sources: Tensor) -> Tensor:
        """``buffer`` (rows', ...) with rows ``sources`` copied into rows ``moved``, narrowed to its first ``rows``."""
        if moved.numel():  # gathered first: a source may be another row's destination
            buffer.index_copy_(0, moved, buffer.index_select(0, sources))
        return buffer[:rows]

    def _select_written(self, buffer: Tensor, index: Tensor, capacity: int) -> Tensor:
        """Rows ``index`` of ``buffer`` (rows, heads, positions, head_dim) in a buffer of ``capacity`` positions:
        the written ones (unwritten ones zero when ``zeroed``, else left unset).  Where the new buffer holds no
        more positions than the old and at least half of them are written, one contiguous gather copies
        them all: faster than the written part's strided copy into a fresh buffer, with the same written
        positions (and zeros where the source holds them)."""
        if capacity < buffer.size(2) or (capacity == buffer.size(2) and 2 * self.length >= capacity):
            return buffer[:, :, :capacity].index_select(0, index)
        selected = buffer.new_empty((index.numel(), buffer.size(1), capacity, buffer.size(3)))
        selected[:, :, : self.length] = buffer[:, :, : self.length].index_select(0, index)
        if self.zeroed:
            selected[:, :, self.length:] = 0
        return selected

    def place(self, slots: Tensor, other: "StaticCache", rows: Tensor):
        """Rows ``slots`` (n,) take the rows ``rows`` (n,) of ``other``, another started cache of the same source
        width (a refill entering the rows finished ones left, straight from its group's cache, both widened to
        the widest source first): their encoder-decoder keys/values and mask are copied in, every position
        written so far becomes padding for them, and the positions ``other`` wrote (a refill's bos, run ahead
        with its group's) are right-aligned to end at this cache's length, as ``concat`` right-aligns a shorter
        cache; their next step writes at this cache's length."""
        if other is self or not other.started or not self.started or self.beams > 1 or other.beams > 1:
            raise ValueError("only another started cache's rows take the place of a running one's (a bug)")
        width = self.cross_keys[0].size(2)
        if other.cross_keys[0].size(2) != width:
            raise ValueError(f"rows of a {other.cross_keys[0].size(2)}-wide source cannot take places in a "
                             f"{width}-wide one: widen both to the widest first (a bug)")
        for mine, theirs in zip(self.cross_keys + self.cross_values, other.cross_keys + other.cross_values):
            mine[slots] = theirs.index_select(0, rows)  # (n, heads, src, hd)
        if self.cross_mask is None:
            self.cross_mask = slots.new_zeros((self.cross_keys[0].size(0), width), dtype=torch.bool)
        self.cross_mask[slots] = False if other.cross_mask is None else other.cross_mask.index_select(0, rows)
        self.cross_origin = self.cross_origin.clone()  # origins stay distinct: the new rows are their own
        self.cross_origin[slots] = int(self.cross_origin.max()) + 1 + torch.arange(slots.numel(), device=slots.device)
        if other.length > self.length:
            self.shift_right(other.length - self.length)
        self.release(slots)
        if other.length:
            self._write_right_aligned(slots, other, rows)

    def _write_right_aligned(self, slots: Tensor, other: "StaticCache", rows: Tensor):
        """The written positions of ``other``'s rows ``rows`` (n,) into rows ``slots`` (n,), ending at this
        cache's length (its own padding with them)."""
        first = self.length - other.length
        for mine, theirs in zip(self.self_keys + self.self_values, other.self_keys + other.self_values):
            mine[slots, :, first: self.length] = theirs[rows, :, : other.length]  # (n, heads, positions, hd)
        padding = other.self_padding
        self.self_padding[slots, first: self.length] = False if padding is None else padding[rows, : other.length]

    def shift_right(self, extra: int):
        """Move every written position ``extra`` positions right; the ``extra`` first become padding for every
        row (a cache that takes rows holding more positions than it does): the cache right-aligned to its length
        plus ``extra``, as ``concat`` right-aligns a shorter cache."""
        length = self.length + extra
        capacity = max(self.capacity, length)
        self.self_padding = self.right_aligned_padding(length, capacity)
        self.self_keys = [self.right_aligned(b, length, capacity) for b in self.self_keys]
        self.self_values = [self.right_aligned(b, length, capacity) for b in self.self_values]
        self.length, self.capacity = length, capacity

    def release(self, rows: Tensor):
        """No row attends the positions ``rows`` (n,) wrote so far (their rows finished or are taken over): they
        are padding for them, and positions no other row attends can go (``drop_leading_padding``)."""
        if self.self_padding is None:
            self.self_padding = rows.new_zeros((self.self_keys[0].size(0), self.capacity), dtype=torch.bool)
        self.self_padding[rows, : self.length] = True
        if self.zeroed:  # a padded step reads them (masked): keep them zero
            for buffer in self.self_keys + self.self_values:
                buffer[rows, :, : self.length] = 0

    def widen_source(self, extra: int):
        """Right-pad the source positions by ``extra`` (masked) columns."""
        pad = lambda buffer: F.pad(buffer, (0, 0, 0, extra))  # noqa: E731
        self.cross_keys = [pad(b) for b in self.cross_keys]
        self.cross_values = [pad(b) for b in self.cross_values]
        rows, src_len = self.cross_keys[0].size(0), self.cross_keys[0].size(2) - extra
        mask = self.cross_mask
        if mask is None:
            mask = self.cross_keys[0].new_zeros((rows, src_len), dtype=torch.bool)
        self.cross_mask = F.pad(mask, (0, extra), value=True)

    def narrow_source(self, width: int):
        """Keep the first ``width`` source positions, the others being padding for every row (a stream whose
        longest sources finished)."""
        if width >= self.cross_keys[0].size(2):
            return
        self.cross_keys = [b[:, :, :width].contiguous() for b in self.cross_keys]  # (rows, heads, width, hd)
        self.cross_values = [b[:, :, :width].contiguous() for b in self.cross_values]
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask[:, :width].contiguous()

    @staticmethod
    def concat(caches: List["StaticCache"]) -> "StaticCache":
        """Rows of several caches, one after the other; narrower sources are left-padded.  Caches at
        different target lengths are right-aligned: a shorter cache's positions move to the end of the
        longest's and the positions left of them become padding (``self_padding``), as ``keep_accepted``
        leaves rows that kept fewer positions (streaming joins rows at different lengths)."""
        length = max(c.length for c in caches)
        merged = StaticCache(max(c.capacity for c in caches), all(c.zeroed for c in caches))
        merged.length = length
        src_len = max(c.cross_keys[0].size(2) for c in caches)
        masks = []
        for cache in caches:
            extra = src_len - cache.cross_keys[0].size(2)
            mask = cache.cross_mask if cache.cross_mask is not None else cache.cross_keys[0].new_zeros(
                (cache.cross_keys[0].size(0), cache.cross_keys[0].size(2)), dtype=torch.bool
            )
            masks.append(F.pad(mask, (extra, 0), value=True))
        for layer in range(len(caches[0].cross_keys)):
            for name in ("cross_keys", "cross_values"):
                parts = [getattr(c, name)[layer] for c in caches]
                parts = [F.pad(p, (0, 0, src_len - p.size(2), 0)) for p in parts]
                getattr(merged, name).append(torch.cat(parts))
            for name in ("self_keys", "self_values"):
                parts = [c.right_aligned(getattr(c, name)[layer], length, merged.capacity) for c in caches]
                getattr(merged, name).append(torch.cat(parts))
        merged.cross_mask = torch.cat(masks)
        if any(c.self_padding is not None or c.length != length for c in caches):
            merged.self_padding = torch.cat([c.right_aligned_padding(length, merged.capacity) for c in caches])
        origins, offset = [], 0
        for cache in caches:  # origins stay distinct across the merged caches
            origins.append(cache.cross_origin + offset)
            offset += int(cache.cross_origin.max()) + 1 if cache.cross_origin.numel() else 0
        merged.cross_origin = torch.cat(origins)
        merged.real_rows = sum(c.real_rows for c in caches)
        return merged

    def right_aligned(self, buffer: Tensor, length: int, capacity: int) -> Tensor:
        """``buffer`` (rows, heads, capacity_i, head_dim) of this cache with its written positions moved
        to end at ``length``, in a buffer of ``capacity`` positions (unwritten ones zero)."""
        shift = length - self.length
        if shift == 0:
            return F.pad(buffer, (0, 0, 0, capacity - buffer.size(2)))
        moved = buffer.new_zeros(buffer.shape[:2] + (capacity,) + buffer.shape[3:])
        moved[:, :, shift:length] = buffer[:, :, : self.length]
        return moved

    def right_aligned_padding(self, length: int, capacity: int) -> Tensor:
        """``self_padding`` (rows, capacity) of this cache's rows once ``right_aligned`` to ``length``."""
        rows, device = self.self_keys[0].size(0), self.self_keys[0].device
        padding = torch.zeros((rows, capacity), dtype=torch.bool, device=device)
        shift = length - self.length
        padding[:, :shift] = True
        if self.self_padding is not None:
            padding[:, shift:length] = self.self_padding[:, : self.length]
        return padding
