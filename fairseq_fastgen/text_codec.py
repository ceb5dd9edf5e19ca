"""fairseq's text pre- and post-processing around a model: ``--tokenizer`` then ``--bpe`` in, the reverse out
(fairseq-interactive's ``encode_fn`` / ``decode_fn``, fairseq-generate's ``decode_fn``).  ``tokenizer`` and
``bpe`` are what ``task.build_tokenizer`` / ``task.build_bpe`` return, None where the option is not given."""


def encode_text(text: str, tokenizer, bpe) -> str:
    if tokenizer is not None:
        text = tokenizer.encode(text)
    if bpe is not None:
        text = bpe.encode(text)
    return text


def decode_text(text: str, tokenizer, bpe) -> str:
    if bpe is not None:
        text = bpe.decode(text)
    if tokenizer is not None:
        text = tokenizer.decode(text)
    return text
