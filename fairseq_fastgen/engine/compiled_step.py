"""What a compiled unit of ``--step-engine compiled`` computes: the decoder step's padded form and its scores.

One module serves every unit of the decoder step: a row bucket through ``torch.compile``,
the unit for every row count and the frozen buckets compiled ahead of time (``aot_step.py``), and
a block of positions per row for blockwise verification.  Its inputs are the padded step's
(``DecoderStep.padded``: the rows' last tokens and positions, the attended mask, the position table,
the cache's buffers, the token embeddings); its outputs are the step's scores, the last layer's encoder
attention and the new keys/values, which the runner writes into the cache after the call (a unit that
does not update its inputs compiles into tighter loops).

The weights it reads are the decoder's parameters and the fused copies of ``fused_weights.py``: passed
as the last input (``torch.compile``'s buckets, whose code stays valid when the weights change) or read
from the ``FusedBuffers`` of the decoder step (frozen units, whose weights become constants of the code).
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_fastgen.engine.decoder_step import DecoderStep
from fairseq_fastgen.engine.fused_weights import FusedWeights


class PaddedStep(nn.Module):
    """The padded decoder step of ``block`` positions per row (``beams`` > 1: sentences of that many beams
    sharing their encoder-decoder keys) with its scores.

    One position per row: log-probabilities (rows, vocab) of the model's projection at ``temperature``, or
    the features (rows, 1, dim) where a cluster projection scores them after the unit (``full_projection``
    False).  A block: the base features (rows, n, dim) (blockwise applies its heads to them) and, with
    ``scores_blocks`` (an identity-first k-head decoder: head 1 is the base output), their log-probabilities
    (rows, n, vocab) beside them.  ``one_position_block``: one position per row returned as a block of one,
    features (rows, 1, dim) and their log-probabilities (rows, 1, vocab) (blockwise's bos position, whose
    heads propose the first block)."""

    def __init__(self, decoder_step: DecoderStep, temperature: float, full_projection: bool, scores_blocks: bool,
                 beams: int = 1, block: int = 1, one_position_block: bool = False):
        super().__init__()
        self.decoder_step = decoder_step  # its parameters and, once set, the fused weights' buffers
        self.temperature, self.full_projection, self.scores_blocks = temperature, full_projection, scores_blocks
        self.beams, self.block = beams, block
        self.one_position_block = one_position_block and block == 1
        self.block_form = block > 1 or self.one_position_block  # outputs shaped (rows, n, ...)

    def forward(self, last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys,
                cross_values, cross_mask, tokens_table, fused: Optional[FusedWeights] = None):
        # tokens_table: the token embeddings (DecoderStep.token_table), or None; fused None: the frozen weights of
        # the decoder step's buffers
        fused = self.decoder_step.fused_buffers.weights() if fused is None else fused
        features, attn, new_keys, new_values = self.decoder_step.padded(
            last_tokens, positions, attended, position_table, self_keys, self_values, cross_keys, cross_values,
            cross_mask, fused.qkv_weights, fused.qkv_biases, self.beams, first_head=not self.block_form,
            tokens_table=tokens_table,
        )
        if self.block_form:
            outputs = [features, self.log_softmax(features, fused)] if self.scores_blocks else features
        else:
            outputs = self.log_softmax(features, fused)[:, -1, :] if self.full_projection else features
        return outputs, attn, new_keys, new_values

    def log_softmax(self, features: Tensor, fused: FusedWeights) -> Tensor:
        """Log-probabilities (rows, n, vocab) of features (rows, n, dim): the model's projection (its weight
        transposed, or its int8 rows under --quantize int8), the temperature, log-softmax."""
        step = self.decoder_step
        int8_rows = None if step.reduced is None else step.reduced.layer("output_projection")
        if fused.output_t is not None and int8_rows is not None:
            logits = int8_rows(features)  # (rows, n, vocab)
        elif fused.output_t is not None:
            logits = features.matmul(fused.output_t)  # (rows, n, vocab)
        else:
            logits = self.decoder_step.decoder.output_layer(features)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return F.log_softmax(logits.float(), dim=-1)

    def shaped(self, beams: int, block: int, decoder_step: Optional[DecoderStep] = None,
               one_position_block: bool = False) -> "PaddedStep":
        """This step for sentences of ``beams`` beams or ``block`` positions per row, or one position returned as
        a block (the same weights; through ``decoder_step``'s products where given: ``DecoderStep.with_products``)."""
        return PaddedStep(decoder_step or self.decoder_step, self.temperature, self.full_projection,
                          self.scores_blocks, beams, block, one_position_block)

    def settings(self) -> tuple:
        """What, besides the weights, the unit's code depends on (for the name of a package on disk)."""
        step = self.decoder_step
        return (self.beams, self.block, type(step.decoder).__qualname__, self.temperature, self.full_projection,
                step.heads, step.head_dim, self.scores_blocks, self.one_position_block, step.blocks_by_position)
