"""A block of positions per row as one-position rows (the padded form under ``blocks_by_position``).

Blockwise verification runs n new positions per row in one step.  Its exact mode promises greedy's tokens, and in
int8 a last-bit difference between the block's arithmetic and greedy's one-position step can move an input row's
integer by one and turn a near-tie.  The block's own attention (each new position over the buffer and the block's
earlier positions, one softmax over ``capacity + n`` scores) sums in another order than the step that reads the
same positions from the buffer.  So here each position j of a row becomes a row of its own (rows x n rows, row
r's positions together): it reads the row's buffers with the block's positions before j written in their slots,
attends those slots besides the row's, and takes its own key and value as the new position, exactly the inputs
greedy's one-position step would have at that position.  Every product and sum then runs the one-position form's
code; the int8 products give each row the same bits whatever rows share the call.

The block's first slot is the one after each row's last attended slot (the cache's length: the rows' positions
end at its last written slot, also after a rollback left-pads a row).
"""

from typing import List

import torch
from torch import Tensor


class BlockRows:
    """The one-position rows of a block: ``attended`` (rows, capacity) the slots each row attends before the block,
    ``n`` the block's positions per row."""

    def __init__(self, attended: Tensor, n: int):
        self.rows, capacity = attended.shape
        self.n = n
        slots = torch.arange(capacity, device=attended.device)  # (capacity,)
        start = torch.where(attended, slots + 1, 0).amax(dim=1, keepdim=True)  # (rows, 1) the block's first slot
        offset = slots - start  # (rows, capacity): a slot's place in the block
        self.in_block = ((offset >= 0) & (offset < n))[:, None, :, None]  # (rows, 1, capacity, 1)
        self.place = offset.clamp(0, n - 1)  # (rows, capacity)
        earlier = torch.arange(n, device=attended.device)[:, None]  # (n, 1): position j reads block places < j
        before_j = (offset[:, None, :] >= 0) & (offset[:, None, :] < earlier)  # (rows, n, capacity)
        self.attended = (attended[:, None, :] | before_j).reshape(self.rows * n, capacity)  # (rows * n, capacity)

    def repeated(self, tensor: Tensor) -> Tensor:
        """A per-row tensor (rows, ...) for every position's row: (rows * n, ...)."""
        return tensor.repeat_interleave(self.n, dim=0)

    def repeated_all(self, tensors: List[Tensor]) -> List[Tensor]:
        return [self.repeated(tensor) for tensor in tensors]

    def per_row(self, new: Tensor) -> Tensor:
        """A new key or value of every position's row (rows * n, heads, head_dim) -> the block's (rows, heads, n,
        head_dim), as the block form returns them."""
        return new.view(self.rows, self.n, *new.shape[1:]).transpose(1, 2)

    def buffer_with_block(self, buffer: Tensor, new: Tensor) -> Tensor:
        """A layer's key or value buffer (rows, heads, capacity, head_dim) with the block's new keys or values
        (rows * n, heads, head_dim) in their slots, for every position's row: (rows * n, heads, capacity,
        head_dim).  A position's row also holds the block's later positions, which it does not attend."""
        block = self.per_row(new)  # (rows, heads, n, head_dim)
        index = self.place[:, None, :, None].expand(-1, block.size(1), -1, block.size(3))  # (rows, heads, cap, hd)
        written = torch.where(self.in_block, block.gather(2, index), buffer)  # (rows, heads, capacity, head_dim)
        return self.repeated(written)
