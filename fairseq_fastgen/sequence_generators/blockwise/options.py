"""Blockwise decoding's options and acceptance criteria: is a proposed token good enough, given p_1 there?

Exact acceptance (the default) keeps greedy's output; ``--blockwise-top-k`` and
``--blockwise-epsilon`` accept more, approximately (policy.py decodes).
"""

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from fairseq.dataclass import FairseqDataclass

from fairseq_fastgen.option_checks import require_finite_in_range, require_int
from fairseq_fastgen.token_lists import listed_tokens


@dataclass
class BlockwiseOptions(FairseqDataclass):
    blockwise_block_size: Optional[int] = field(
        default=None,
        metadata={"help": "blockwise: tokens proposed per iteration, at most the model's number of heads "
                          "(default: all of them)"},
    )
    blockwise_top_k: int = field(
        default=0,
        metadata={"help": "blockwise: accept a proposed token if it is among the N most probable tokens of "
                          "head 1 (approximate; 0: exact acceptance, identical to greedy)"},
    )
    blockwise_epsilon: Optional[float] = field(
        default=None,
        metadata={"help": "blockwise: accept a proposed ordinal symbol whose value differs by at most E from "
                          "head 1's choice (approximate; see --blockwise-ordinal-symbols)"},
    )
    blockwise_ordinal_symbols: str = field(
        default=r"^-?[0-9]+$",
        metadata={"help": "blockwise: regular expression selecting the target symbols that are numbers "
                          "(ordinal symbols) for --blockwise-epsilon; their value is the number they spell"},
    )
    blockwise_min_block: int = field(
        default=1,
        metadata={"help": "blockwise: accept at least this many proposed tokens per iteration, verified or "
                          "not (approximate when > 1), at most --blockwise-block-size"},
    )
    blockwise_int8_proposals: bool = field(
        default=False,
        metadata={"help": "blockwise: compute the proposals of heads 2..k from int8 rows of the k-head layer "
                          "and the output projection (CPU only). Head 1 still verifies in full precision, so "
                          "exact acceptance keeps greedy's output. The default on the CPU with exact acceptance "
                          "(--blockwise-full-proposals turns it off); with --blockwise-top-k/-epsilon/-min-block, "
                          "where the output may change, only when given"},
    )
    blockwise_full_proposals: bool = field(
        default=False,
        metadata={"help": "blockwise: heads 2..k propose in the model's own precision, as fairseq's k-head "
                          "decoder does, also where int8 proposals are the default (the CPU, exact acceptance: "
                          "the same output, fewer tokens accepted now and then, faster iterations)"},
    )
    blockwise_proposal_vocab: Optional[str] = field(
        default=None,
        metadata={"help": "blockwise, with int8 proposals: a file of the target tokens heads 2..k may "
                          "propose, in fairseq's dictionary format (a 'token count' line each: e.g. the first N "
                          "lines of a dict.TGT.txt that fairseq-preprocess counted on the training targets); the "
                          "proposals' projection then reads only their rows. Exact acceptance still gives "
                          "greedy's output; a token left out is never proposed (default: every token)"},
    )


# ---- acceptance criteria: is a proposed token good enough, given p_1 there? ------------------
class ExactMatch:
    """The proposal must be greedy's choice."""

    def accepts(self, proposed: Tensor, lprobs: Tensor, best: Tensor) -> Tensor:
        """proposed, best: (rows, m); lprobs: (rows, m, vocab) -> (rows, m) bool."""
        return proposed.eq(best)


class TopK:
    """The proposal must be among the ``k`` most probable tokens of p_1 (and allowed)."""

    def __init__(self, k):
        self.k = k

    def accepts(self, proposed, lprobs, best):
        top = lprobs.topk(min(self.k, lprobs.size(-1)), dim=-1).indices  # (rows, m, k)
        allowed = lprobs.gather(2, proposed.unsqueeze(2)).squeeze(2) > -math.inf
        return top.eq(proposed.unsqueeze(2)).any(dim=2) & allowed


class OrdinalDistance:
    """Both tokens ordinal symbols whose values differ by at most ``epsilon`` (or equal tokens)."""

    def __init__(self, values: Tensor, epsilon: float):
        self.values = values  # (vocab,) float: the value of each ordinal symbol, nan for the others
        self.epsilon = epsilon

    def accepts(self, proposed, lprobs, best):
        values = self.values.to(proposed.device)
        close = (values[proposed] - values[best]).abs() <= self.epsilon  # nan: False
        allowed = lprobs.gather(2, proposed.unsqueeze(2)).squeeze(2) > -math.inf
        return proposed.eq(best) | (close & allowed)


def ordinal_values(tgt_dict, pattern: str) -> Tensor:
    """Value of every target symbol matching ``pattern`` (nan for the others)."""
    try:
        matcher = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"--blockwise-ordinal-symbols {pattern!r} is not a regular expression: {error}") from error
    values = torch.full((len(tgt_dict),), math.nan)
    for index, symbol in enumerate(tgt_dict.symbols):
        if matcher.search(symbol):
            try:
                values[index] = float(symbol)
            except ValueError as error:
                raise ValueError(
                    f"--blockwise-ordinal-symbols {pattern!r} matches {symbol!r}, which is not a number"
                ) from error
    if torch.isnan(values).all():
        raise ValueError(f"--blockwise-ordinal-symbols {pattern!r} matches no symbol of the target dictionary")
    return values


def exact_acceptance(acceptance, min_block: int) -> bool:
    """Whether every accepted token is head 1's own choice (greedy's output whatever heads 2..k propose)."""
    return isinstance(acceptance, ExactMatch) and min_block == 1


def int8_proposals(options: BlockwiseOptions, exact: bool) -> Optional[str]:
    """Whether heads 2..k propose from int8 rows: "asked" (--blockwise-int8-proposals), "default" (exact
    acceptance, where they leave the output as it is: used where the runner makes them, on the CPU), or None."""
    if options.blockwise_int8_proposals and options.blockwise_full_proposals:
        raise ValueError("--blockwise-int8-proposals and --blockwise-full-proposals contradict each other; give one")
    if options.blockwise_int8_proposals:
        return "asked"
    return "default" if exact and not options.blockwise_full_proposals else None


def proposal_tokens(options: BlockwiseOptions, tgt_dict, int8: bool) -> Optional[Tensor]:
    """The target tokens (N,) long, ascending, of ``--blockwise-proposal-vocab`` (the special symbols always
    among them), or None: every token.  ``int8``: whether the proposals are int8 (the list needs them)."""
    path = options.blockwise_proposal_vocab
    if path is None:
        return None
    if not int8:
        raise ValueError(f"--blockwise-proposal-vocab {path} applies with int8 proposals (their projection reads the "
                         f"listed tokens' rows): the default on the CPU with exact acceptance, else "
                         f"--blockwise-int8-proposals")
    return listed_tokens(path, tgt_dict, "--blockwise-proposal-vocab")


def build_acceptance(options: BlockwiseOptions, tgt_dict):
    top_k = options.blockwise_top_k
    epsilon = options.blockwise_epsilon
    if top_k and epsilon is not None:
        raise ValueError("--blockwise-top-k and --blockwise-epsilon are alternative acceptance criteria; give one")
    require_int("--blockwise-top-k", top_k, 0)
    if top_k:
        return TopK(top_k)
    if epsilon is not None:
        epsilon = require_finite_in_range("--blockwise-epsilon", epsilon, 0)  # NaN: nothing would be close
        return OrdinalDistance(ordinal_values(tgt_dict, options.blockwise_ordinal_symbols), epsilon)
    return ExactMatch()
