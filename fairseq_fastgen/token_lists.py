"""Lists of target tokens read from a file in fairseq's dictionary format (``token count`` lines).

Blockwise decoding's ``--blockwise-proposal-vocab`` (the only tokens heads 2..k propose) and
``random_subloss``'s ``--proposal-vocab`` (the only tokens heads 2..k learn to choose among) read the same file.
"""

import torch
from torch import Tensor


def listed_tokens(path: str, tgt_dict, option: str) -> Tensor:
    """The target tokens (N,) long, ascending, that ``path`` lists, the special symbols (bos, pad, eos, unk) always
    among them: a row at the length limit must still propose eos.  A ValueError naming ``option`` where the file
    cannot be read or names a symbol the dictionary does not hold."""
    try:
        with open(path, encoding="utf-8") as lines:
            symbols = [(number, line.split()[0]) for number, line in enumerate(lines, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{option} {path} cannot be read: {error}") from error
    tokens = set(range(tgt_dict.nspecial))
    for number, symbol in symbols:
        index = tgt_dict.index(symbol)
        if index == tgt_dict.unk() and symbol != tgt_dict.unk_word:
            raise ValueError(f"{option} {path}, line {number}: {symbol!r} is not a token of the model's target "
                             f"dictionary")
        tokens.add(index)
    return torch.tensor(sorted(tokens), dtype=torch.long)
