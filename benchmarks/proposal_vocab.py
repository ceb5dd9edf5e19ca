"""A file for ``--blockwise-proposal-vocab``: the N target tokens most frequent in a data-bin's training targets
(not part of the product: fairseq-preprocess's own dictionaries are counted and sorted already, so their first N
lines serve; the Multi30k data-bins of benchmarks/ take their dictionary from sentencepiece, every count 1).

    python benchmarks/proposal_vocab.py DATA_BIN --top 4000 --output FILE [--split train] [--also TOKENS_FILE]

Writes ``token count`` lines, most frequent first, as fairseq's dictionaries; prints the share of the split's
target tokens (and of ``--coverage-split``'s) that the list holds.  ``--also``: a file of more symbols (one a line,
or fairseq-generate's output, whose ``H-`` lines' tokens are read) always listed, e.g. what an untrained model
writes, so that a speed row holds its acceptance equal.
"""

import argparse
from pathlib import Path

import numpy as np

from fairseq.data import Dictionary, data_utils


def target_pair(data_bin: Path, split: str):
    """(source, target) languages of ``split``'s files in ``data_bin`` (``SPLIT.SRC-TGT.TGT.idx``)."""
    for index in sorted(data_bin.glob(f"{split}.*-*.*.idx")):
        pair, lang = index.name[len(split) + 1:].split(".")[:2]
        source, target = pair.split("-")
        if lang == target:
            return source, target
    raise SystemExit(f"proposal_vocab.py: no {split}.SRC-TGT.TGT.idx in {data_bin}")


def token_counts(data_bin: Path, split: str, dictionary: Dictionary) -> np.ndarray:
    """(vocab,) how often each target token occurs in ``split``."""
    source, target = target_pair(data_bin, split)
    dataset = data_utils.load_indexed_dataset(str(data_bin / f"{split}.{source}-{target}.{target}"), dictionary)
    tokens = np.concatenate([dataset[index].numpy() for index in range(len(dataset))])
    return np.bincount(tokens, minlength=len(dictionary))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_bin", type=Path)
    parser.add_argument("--top", type=int, required=True, help="how many of the most frequent tokens to list")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--split", default="train")
    parser.add_argument("--coverage-split", default="test", help="also report the share of this split's tokens")
    parser.add_argument("--also", type=Path, help="more symbols to list (one a line, or fairseq-generate output)")
    args = parser.parse_args()
    _, target = target_pair(args.data_bin, args.split)
    dictionary = Dictionary.load(str(args.data_bin / f"dict.{target}.txt"))
    counts = token_counts(args.data_bin, args.split, dictionary)
    order = [int(token) for token in np.argsort(-counts, kind="stable") if token >= dictionary.nspecial]
    listed = [token for token in order[: args.top] if counts[token] > 0]
    if args.also:
        lines = args.also.read_text(encoding="utf-8").splitlines()
        written = [line.split("\t")[2].split() if line.startswith("H-") else line.split()[:1] for line in lines]
        listed += sorted({dictionary.index(symbol) for symbols in written for symbol in symbols} - set(listed))
    args.output.write_text("".join(f"{dictionary[token]} {counts[token]}\n" for token in listed), encoding="utf-8")
    held = np.zeros(len(dictionary), dtype=bool)
    held[listed] = True
    held[: dictionary.nspecial] = True
    for split in dict.fromkeys([args.split, args.coverage_split]):
        split_counts = counts if split == args.split else token_counts(args.data_bin, split, dictionary)
        share = split_counts[held].sum() / max(split_counts.sum(), 1)
        print(f"{split}: {100 * share:.2f}% of the target tokens among the {len(listed)} listed")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
