"""``transformer_khead``: a transformer that predicts the next k tokens at once.

Blockwise parallel decoding (Stern, Shazeer and Uszkoreit, 2018) needs a model
whose decoder, at every position, proposes the token 1, 2, ..., k positions
ahead.  This architecture is a stock fairseq transformer with one extra
feed-forward layer after the decoder: the decoder output ``x`` (dim d) goes
through a hidden layer of size k * ffn_dim to an output of size k * d, split
into k vectors; each is added to ``x`` (a residual per head) and projected with
the model's own output projection, giving the logits of p_1 .. p_k.

Everywhere fairseq expects a transformer, the model behaves as one whose output
is p_1: ``extract_features`` returns the head-1 features and ``forward`` the
head-1 logits, so stock beam search, ``--decoder greedy`` and the cluster
projection use p_1.  ``forward`` also returns the features of every head in its
extra dict (``khead_features``, (batch, tgt_len, k, dim)); the
``random_subloss`` criterion projects only the heads it trains
(``output_layer`` of a slice gives that head's logits), and :meth:`KHeadTransformerDecoder.forward_block`
runs several new positions per row against an incremental cache (blockwise
decoding's verification pass).
"""

import logging
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from fairseq import checkpoint_utils, utils
from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_REGISTRY,
    register_model,
    register_model_architecture,
)
from fairseq.models.transformer import TransformerDecoderBase, TransformerModel, base_architecture
from fairseq.modules import FairseqDropout

from fairseq_fastgen.refusals import UsageError

logger = logging.getLogger(__name__)

Cache = Dict[str, Dict[str, Optional[Tensor]]]


@dataclass
class KHeadOptions(FairseqDataclass):
    block_size: int = field(
        default=4,
        metadata={"help": "k: number of heads; head i predicts the token i positions ahead (k >= 1)"},
    )
    khead_identity_first: bool = field(
        default=False,
        metadata={"help": "head 1 is the unchanged base output (p_1 keeps the base model's predictions "
                          "exactly); the extra layer then only produces heads 2..k"},
    )
    khead_ffn_dim: Optional[int] = field(
        default=None,
        metadata={"help": "hidden size per head of the k-head layer (its hidden layer is block size x this wide); "
                          "default: --decoder-ffn-embed-dim. Every blockwise iteration reads the whole layer once: "
                          "at base size with the default it holds 17M parameters, read besides the decoder's 25M "
                          "(docs/benchmarks.md, 'What an iteration costs'); a smaller one proposes sooner"},
    )
    freeze_base: bool = field(
        default=False,
        metadata={"help": "train only the k-head layer: every parameter of the base transformer gets "
                          "requires_grad False"},
    )
    base_checkpoint: Optional[str] = field(
        default=None,
        metadata={"help": "warm start: load the weights of this stock transformer checkpoint (same "
                          "dimensions and dictionaries) before training"},
    )


# Hyperparameters that decide the shape or the computation of a base transformer's
# weights: a --base-checkpoint must agree with the new model on each of them.
BASE_HYPERPARAMETERS = (
    "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_normalize_before", "decoder_normalize_before", "encoder_learned_pos", "decoder_learned_pos",
    "decoder_output_dim", "decoder_input_dim", "share_decoder_input_output_embed", "share_all_embeddings",
    "no_token_positional_embeddings", "layernorm_embedding", "no_scale_embedding", "activation_fn",
    "no_cross_attention", "cross_self_attention", "adaptive_input", "adaptive_softmax_cutoff",
)


class KHeadLayer(nn.Module):
    """The one feed-forward layer that turns a decoder output into k head outputs.

    ``forward(x (..., dim)) -> (..., k, dim)``: head i is ``x + y_i`` where
    ``y = fc2(act(fc1(x)))`` has k (or k - 1 with ``identity_first``) slices of
    size dim.  fc2 starts at zero, so every head starts as the base prediction.
    """

    def __init__(self, dim, ffn_dim, block_size, identity_first, activation_fn, dropout, activation_dropout):
        super().__init__()
        if block_size < 1:
            raise UsageError(f"--block-size must be >= 1, got {block_size}")
        if ffn_dim < 1:
            raise UsageError(f"--khead-ffn-dim must be >= 1, got {ffn_dim}")
        self.dim = dim
        self.block_size = block_size
        self.identity_first = identity_first
        self.learned_heads = block_size - 1 if identity_first else block_size
        self.fc1 = self.fc2 = None
        if self.learned_heads > 0:
            self.fc1 = nn.Linear(dim, block_size * ffn_dim)
            nn.init.xavier_uniform_(self.fc1.weight)
            nn.init.zeros_(self.fc1.bias)
            self.fc2 = nn.Linear(block_size * ffn_dim, self.learned_heads * dim)
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.activation_dropout_module = FairseqDropout(activation_dropout, module_name=self.__class__.__name__)

    def forward(self, x: Tensor) -> Tensor:
        base = x.unsqueeze(-2)  # (..., 1, dim)
        if self.learned_heads == 0:
            return base
        heads = self.learned(x)  # (..., learned_heads, dim)
        if self.identity_first:
            heads = torch.cat([base, heads], dim=-2)
        return heads  # (..., k, dim)

    def learned(self, x: Tensor, fc1=None, fc2=None) -> Tensor:
        """The learned heads (..., learned_heads, dim) of ``x`` (..., dim): ``x + fc2(act(fc1(x)))``.

        ``fc1``/``fc2``: callables in place of the layer's own (int8 copies for blockwise proposals).
        """
        fc1 = self.fc1 if fc1 is None else fc1
        fc2 = self.fc2 if fc2 is None else fc2
        hidden = self.activation_dropout_module(self.activation_fn(fc1(x)))  # (..., k * ffn)
        offsets = self.dropout_module(fc2(hidden))  # (..., learned_heads * dim)
        return x.unsqueeze(-2) + offsets.view(x.shape[:-1] + (self.learned_heads, self.dim))

    def first(self, x: Tensor) -> Tensor:
        """Head-1 features of ``x`` (..., dim), computed as in :meth:`forward`."""
        if self.identity_first:
            return x
        return self.forward(x)[..., 0, :]


class KHeadTransformerDecoder(TransformerDecoderBase):
    """A transformer decoder whose output goes through a :class:`KHeadLayer`.

    ``heads`` is attached by :class:`KHeadTransformerModel` after the stock
    decoder is built (fairseq builds the decoder from a TransformerConfig,
    which has no room for the k-head options).
    """

    heads: KHeadLayer

    @property
    def block_size(self) -> int:
        return self.heads.block_size

    # ---- the interface of a fairseq decoder: head 1 ------------------------------------
    def extract_features(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[Cache] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        """Head-1 features (batch, tgt_len, dim): ``output_layer`` of them gives p_1."""
        x, extra = super().extract_features(
            prev_output_tokens, encoder_out, incremental_state, full_context_alignment, alignment_layer, alignment_heads
        )
        return self.heads.first(x), extra

    def forward(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[Cache] = None,
        features_only: bool = False,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        src_lengths=None,
        return_all_hiddens: bool = False,
    ):
        """p_1 logits (batch, tgt_len, vocab); with a full sequence (training,
        scoring) also ``extra["khead_features"]`` (batch, tgt_len, k, dim), the
        input of the output projection for every head."""
        x, extra = super().extract_features(
            prev_output_tokens, encoder_out, incremental_state, full_context_alignment, alignment_layer, alignment_heads
        )
        if incremental_state is not None or features_only:  # one step of a stock generator
            first = self.heads.first(x)
            return (first if features_only else self.output_layer(first)), extra
        features = self.heads(x)  # (batch, tgt_len, k, dim)
        extra["khead_features"] = features
        return self.output_layer(features[:, :, 0]), extra

    def trainable_heads(self) -> List[int]:
        """Indices of the heads whose output depends on a parameter being trained."""
        base_trains = any(p.requires_grad for name, p in self.named_parameters() if not name.startswith("heads."))
        layer_trains = self.heads.fc1 is not None and self.heads.fc1.weight.requires_grad
        first = [0] if base_trains or (layer_trains and not self.heads.identity_first) else []
        return first + (list(range(1, self.block_size)) if layer_trains or base_trains else [])

    # ---- blockwise decoding: several new positions per row ---------------------------------
    def forward_block(self, tokens: Tensor, positions: Tensor, encoder_out, cache: Cache):
        """Run n new positions per row against the rows' cached earlier positions.

        tokens: (rows, n) decoder inputs; positions: (rows, n) their target
        positions (0 is the bos position).  New position j attends to the cached
        positions of its row (``cache`` may hold left padding, masked through
        its ``prev_key_padding_mask``) and to new positions <= j.  The new
        keys/values are appended to ``cache``; drop rejected ones with
        :meth:`rollback`.
        Returns the base decoder output (rows, n, dim) (apply ``heads`` for the
        head features) and the encoder attention (rows, n, src_len) or None.
        """
        n = tokens.size(1)  # new positions per row
        x = self.embed_scale * self.embed_tokens(tokens)  # (rows, n, dim)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if self.embed_positions is not None:
            x += self.position_embeddings(positions)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x).transpose(0, 1)  # (n, rows, dim)

        encoder_states = _first(encoder_out, "encoder_out")  # (src_len, rows, dim) or None
        encoder_mask = _first(encoder_out, "encoder_padding_mask")  # (rows, src_len) or None
        self_attn_mask = None  # (n, cached + n): causal among the new positions
        if n > 1:
            causal = utils.fill_with_neg_inf(x.new_zeros(n, n)).triu(1)  # (n, n)
            self_attn_mask = torch.cat([x.new_zeros(n, self.cached_length(cache)), causal], dim=1)
        # the new positions are never padding: without a key padding mask the attention
        # extends the cache's own mask (left padding after a rollback) with zeros, and
        # while the cache has none (rows all aligned), it masks nothing
        attn = None
        for index, layer in enumerate(self.layers):
            last = index == self.num_layers - 1
            x, layer_attn, _ = layer(
                x, encoder_states, encoder_mask, cache, self_attn_mask=self_attn_mask,
                need_attn=last, need_head_weights=last,
            )
            if last and layer_attn is not None:
                attn = layer_attn.float().to(x).mean(dim=0)  # (rows, n, src_len)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)  # (rows, n, dim)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, attn

    def position_embeddings(self, positions: Tensor) -> Tensor:
        """Embeddings (rows, n, dim) of target positions (rows, n), as the decoder
        embeds them (fairseq numbers positions from padding_idx + 1)."""
        prefix = positions.new_full((1, int(positions.max()) + 1), self.padding_idx + 1)  # any non-pad symbol
        table = self.embed_positions(prefix)[0]  # (max_position + 1, dim)
        return table[positions]

    def cached_length(self, cache: Cache) -> int:
        buffer = self.layers[0].self_attn._get_input_buffer(cache)
        keys = buffer.get("prev_key")
        return 0 if keys is None else keys.size(2)

    def rollback(self, cache: Cache, accepted: Tensor):
        """Keep, of the n positions the last :meth:`forward_block` added, those where
        ``accepted`` (rows, n) holds; drop the others from the self-attention cache.

        Each row's remaining positions move, in order, to the right end of the
        cache; the columns left of them become padding, masked in
        ``prev_key_padding_mask``.  The cache is as wide as the longest row.
        """
        buffer = self.layers[0].self_attn._get_input_buffer(cache)
        counts = accepted.sum(dim=1)  # (rows,) a prefix of each row's new positions
        if bool(counts.eq(counts[0]).all()):  # every row drops its last n - count positions: a slice
            dropped = accepted.size(1) - int(counts[0])
            if dropped:
                self.drop_last_positions(cache, dropped)
            return
        padding = buffer.get("prev_key_padding_mask")  # (rows, cached); None: no padding yet
        if padding is None:
            keep = accepted.new_ones((accepted.size(0), self.cached_length(cache)), dtype=torch.bool)  # (rows, cached)
        else:
            keep = ~padding.bool()  # (rows, cached)
        keep[:, keep.size(1) - accepted.size(1):] &= accepted  # some row drops a new position here
        width = int(keep.sum(dim=1).max())
        order = torch.sort(keep.int(), dim=1, stable=True).indices[:, -width:]  # (rows, width): dropped ones first
        kept_padding = ~keep.gather(1, order)  # (rows, width)
        for layer in self.layers:
            buffer = layer.self_attn._get_input_buffer(cache)
            keys = buffer["prev_key"]  # (rows, heads, cached, head_dim)
            index = order[:, None, :, None].expand(keys.size(0), keys.size(1), width, keys.size(3))
            buffer["prev_key"] = keys.gather(2, index)
            buffer["prev_value"] = buffer["prev_value"].gather(2, index)
            buffer["prev_key_padding_mask"] = kept_padding
            layer.self_attn._set_input_buffer(cache, buffer)

    def drop_last_positions(self, cache: Cache, dropped: int):
        """Drop the last ``dropped`` cached positions of every row (views; the cache stays as wide
        as the longest row, since every row loses the same positions)."""
        for layer in self.layers:
            buffer = layer.self_attn._get_input_buffer(cache)
            for name in ("prev_key", "prev_value"):  # (rows, heads, cached, head_dim)
                buffer[name] = buffer[name][:, :, :-dropped]
            padding = buffer.get("prev_key_padding_mask")  # (rows, cached) or None
            buffer["prev_key_padding_mask"] = None if padding is None else padding[:, :-dropped]
            layer.self_attn._set_input_buffer(cache, buffer)


def _first(encoder_out, key) -> Optional[Tensor]:
    return encoder_out[key][0] if encoder_out and encoder_out[key] else None


@register_model("transformer_khead")
class KHeadTransformerModel(TransformerModel):
    """A stock transformer plus k prediction heads (see the module docstring)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, KHeadOptions())

    @classmethod
    def build_model(cls, args, task):
        khead_defaults(args)
        if getattr(args, "adaptive_softmax_cutoff", None):
            raise UsageError("transformer_khead does not support --adaptive-softmax-cutoff")
        model = super().build_model(args, task)
        decoder = model.decoder
        ffn_dim = args.decoder_ffn_embed_dim if args.khead_ffn_dim is None else args.khead_ffn_dim
        decoder.heads = KHeadLayer(
            decoder.output_embed_dim, ffn_dim, args.block_size, args.khead_identity_first,
            args.activation_fn, args.dropout, getattr(args, "activation_dropout", 0.0),
        )
        if args.base_checkpoint:
            warm_start(model, args.base_checkpoint, args)
            # the weights now live in this model's own checkpoints: a saved k-head
            # checkpoint must not read the base checkpoint again when it is loaded
            args.khead_warm_started_from = args.base_checkpoint
            args.base_checkpoint = None
        if args.freeze_base:
            for name, parameter in model.named_parameters():
                if not name.startswith("decoder.heads."):
                    parameter.requires_grad_(False)
        return model

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return KHeadTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def prepare_for_inference_(self, cfg):
        """As fairseq's (fairseq-generate, -interactive and the hub interface call it before decoding), and a
        frozen base's parameters (--freeze-base) need a gradient again: no decode computes one, and torch multiplies
        a step's transposed (rows, 1, dim) features by a weight that needs none row by row instead of as one matrix
        (``ops/aligned_rows.folds``): at 64 rows the vocabulary projection ran 7x slower, in other sums than the
        base model's own projection."""
        super().prepare_for_inference_(cfg)
        for parameter in self.parameters():
            parameter.requires_grad_(True)


def khead_defaults(args):
    for option, default in vars(KHeadOptions()).items():
        if not option.startswith("_") and getattr(args, option, None) is None:
            setattr(args, option, default)


def warm_start(model, path, args):
    """Load the weights of a stock transformer checkpoint into ``model``'s base."""
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    base_args = _saved_model_args(state)
    differing = [
        f"--{name.replace('_', '-')} (checkpoint: {base_args.get(name)!r}, this model: {getattr(args, name, None)!r})"
        for name in BASE_HYPERPARAMETERS
        if name in base_args and base_args.get(name) != getattr(args, name, None)
    ]
    weights = model.upgrade_state_dict(state["model"]) or state["model"]
    own = model.state_dict()
    differing += [
        f"{key} shape (checkpoint: {tuple(value.shape)}, this model: {tuple(own[key].shape)}; "
        "dictionaries or --max-*-positions differ?)"
        for key, value in weights.items()
        if key in own and own[key].shape != value.shape
    ]
    if differing:
        raise UsageError(f"--base-checkpoint {path} does not match this transformer_khead: " + "; ".join(differing))
    missing, unexpected = nn.Module.load_state_dict(model, weights, strict=False)
    missing = [key for key in missing if not key.startswith("decoder.heads.")]
    if missing or unexpected:
        raise UsageError(
            f"--base-checkpoint {path} is not a stock transformer of this shape: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    logger.info("transformer_khead: base weights loaded from %s", path)


def _saved_model_args(state) -> dict:
    saved = state.get("cfg", {}).get("model") if state.get("cfg") else state.get("args")
    if saved is None:
        return {}
    return vars(saved) if isinstance(saved, Namespace) else dict(saved)


# ---- architectures: transformer_khead plus one per stock transformer preset ---------------
@register_model_architecture("transformer_khead", "transformer_khead")
def khead_base_architecture(args):
    base_architecture(args)
    khead_defaults(args)


def _register_presets():
    """transformer_X -> transformer_khead_X for every architecture of the stock transformer."""
    stock_presets = [name for name, model in ARCH_MODEL_REGISTRY.items()
                     if model is TransformerModel and name != "transformer"]
    for stock_name in stock_presets:
        suffix = stock_name[len("transformer_"):] if stock_name.startswith("transformer_") else stock_name
        register_model_architecture("transformer_khead", f"transformer_khead_{suffix}")(_preset(stock_name))


def _preset(stock_name):
    stock = ARCH_CONFIG_REGISTRY[stock_name]

    def preset(args):
        stock(args)
        khead_defaults(args)

    preset.__name__ = f"khead_{stock_name}"
    return preset


_register_presets()
