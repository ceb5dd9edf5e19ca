"""A fairseq checkpoint converted for CTranslate2 (the peer that fastgen-bench and fastgen-serve --peer measure):
whether CTranslate2 is installed, and the converted model, cached under ``$FASTGEN_CACHE`` keyed by the checkpoint
file, the data directory and CTranslate2's version."""

import pickle
from pathlib import Path
from typing import List

from fairseq_fastgen.safe_files import cached_build

# what CTranslate2's converter raises for a checkpoint it cannot convert
CONVERSION_ERRORS = (ValueError, NotImplementedError, KeyError, AttributeError, RuntimeError, pickle.UnpicklingError)


def import_ctranslate2():
    """(module, None) or (None, note saying why it is not measured)."""
    try:
        import ctranslate2
    except ImportError:
        return None, "CTranslate2 is not installed (pip install ctranslate2): not measured"
    return ctranslate2, None


def convert(ctranslate2, checkpoint: str, data_dir: str, source_lang=None, target_lang=None) -> Path:
    from ctranslate2.converters import FairseqConverter

    checkpoint_file = Path(checkpoint).resolve()
    stat = checkpoint_file.stat()
    key = [checkpoint_file, stat.st_size, stat.st_mtime_ns, Path(data_dir).resolve(), source_lang, target_lang,
           ctranslate2.__version__]

    def build(output_dir):
        converter = FairseqConverter(str(checkpoint_file), data_dir, source_lang=source_lang, target_lang=target_lang)
        converter.convert(str(output_dir), force=True)

    return cached_build("ctranslate2", key, build)


QUANTIZE_COMPUTE_TYPES = {"int8": "int8", "bf16": "bfloat16"}  # --quantize -> CTranslate2's compute_type


def source_symbols(src_tokens, src_dict) -> List[List[str]]:
    """A fairseq batch's sources (``src_tokens`` (sentences, source length), eos included) as the symbol lists
    CTranslate2 takes: pad and eos left out."""
    skipped = {src_dict.pad(), src_dict.eos()}
    return [[src_dict[t] for t in row if t not in skipped] for row in src_tokens.cpu().tolist()]


def decoding_length_cap(gen_cfg, src_len: int, max_positions: int) -> int:
    """fairseq SequenceGenerator's limit on a hypothesis's length for a batch whose sources are ``src_len`` wide."""
    return min(int(gen_cfg.max_len_a * src_len + gen_cfg.max_len_b), max_positions - 1)
