"""CTranslate2 beside fairseq: the same checkpoint, converted once, on the same batches.

Measured only when ``import ctranslate2`` works and the checkpoint converts
(CTranslate2 converts fairseq's stock transformer architectures); otherwise
the bench records a note.  The converted model is cached under
``$FASTGEN_CACHE`` (default ``~/.cache/fairseq_fastgen``), keyed by the
checkpoint file, the data directory and the CTranslate2 version.  The
conversion runs in this process, so the plugin's checkpoint allow-list lets
torch load the checkpoint with ``weights_only=True``.
"""

import logging
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from fairseq import utils

from fairseq_fastgen.bench.measure import Candidate
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.ctranslate2_model import (CONVERSION_ERRORS, QUANTIZE_COMPUTE_TYPES, convert, decoding_length_cap,
                                               import_ctranslate2, source_symbols)

logger = logging.getLogger("fastgen_bench")

def translate_sample(translator, sample, src_dict, tgt_dict, **search) -> Dict[int, List[int]]:
    """{sentence id: best tokens, ending in eos as fairseq's hypotheses} of CTranslate2's ``translate_batch`` on
    one fairseq batch (its source tokens as symbols, pad and eos left out), the whole batch at once, with the
    search options ``search`` (beam_size, length_penalty, ...)."""
    sources = source_symbols(sample["net_input"]["src_tokens"], src_dict)
    translations = translator.translate_batch(sources, max_batch_size=0, num_hypotheses=1, **search)
    return {sentence_id: [tgt_dict.index(symbol) for symbol in translation.hypotheses[0]] + [tgt_dict.eos()]
            for sentence_id, translation in zip(sample["id"].tolist(), translations)}


def shared_threads_note(threads: int, use_cuda: bool) -> Optional[str]:
    """The note a CPU run with more than one thread carries: CTranslate2 measured in the bench's own process runs
    slower once torch has run on several threads there (torch's idle thread pool competes with CTranslate2's),
    so its rows understate it; ``benchmarks/peer_alone.py`` runs each in a process of its own."""
    if use_cuda or threads <= 1:
        return None
    return (f"CTranslate2 shares this process with torch's {threads} threads and runs slower than alone (about "
            f"40% slower with 2 threads on a 2-core machine): compare with benchmarks/peer_alone.py, which runs "
            f"each in a process of its own")


def matching_compute_type(cfg) -> str:
    """CTranslate2's compute_type in the precision the decoders compute in (--quantize, --fp16)."""
    quantize = getattr(cfg.generation, "quantize", None)
    if quantize:
        return QUANTIZE_COMPUTE_TYPES[str(quantize)]
    return "float16" if cfg.common.fp16 else "default"


class CTranslate2Peer:
    """A converted model: one Translator shared by every CTranslate2 configuration."""

    def __init__(self, ctranslate2, model_dir: Path, inputs, compute_type: Optional[str] = None):
        device = "cuda" if inputs.use_cuda else "cpu"
        self.compute_type = compute_type or matching_compute_type(inputs.cfg)
        try:
            self.translator = ctranslate2.Translator(
                str(model_dir), device=device, compute_type=self.compute_type,
                intra_threads=torch.get_num_threads() if device == "cpu" else 0,
            )
        except ValueError as error:  # a compute type this build or device does not offer
            raise UsageError(f"CTranslate2 cannot run compute_type {self.compute_type!r} here: {error}") from error
        self.inputs = inputs
        self.model_dir = model_dir

    @classmethod
    def create(cls, inputs, compute_type: Optional[str] = None) -> Tuple[Optional["CTranslate2Peer"], Optional[str]]:
        """(peer, None), or (None, note saying why CTranslate2 is not measured)."""
        ctranslate2, note = import_ctranslate2()
        if ctranslate2 is None:
            return None, note
        if inputs.use_cuda and ctranslate2.get_cuda_device_count() == 0:
            return None, "CTranslate2 is installed without CUDA support: not measured on this GPU run"
        checkpoints = utils.split_paths(inputs.cfg.common_eval.path)
        if len(checkpoints) != 1:
            return None, "CTranslate2 converts one checkpoint, not an ensemble: not measured"
        task_cfg = inputs.cfg.task
        try:
            model_dir = convert(
                ctranslate2, checkpoints[0], utils.split_paths(task_cfg.data)[0],
                getattr(task_cfg, "source_lang", None), getattr(task_cfg, "target_lang", None),
            )
        except CONVERSION_ERRORS as error:
            return None, f"CTranslate2 could not convert {checkpoints[0]}: {error}: not measured"
        peer = cls(ctranslate2, model_dir, inputs, compute_type)
        logger.info("CTranslate2 %s model in %s, compute_type %s", ctranslate2.__version__, model_dir, peer.compute_type)
        return peer, f"CTranslate2 {ctranslate2.__version__}, compute_type {peer.compute_type}"

    def candidate(self, gen_cfg, beam: int) -> "CTranslate2Candidate":
        return CTranslate2Candidate(self, gen_cfg, beam)


class CTranslate2Candidate(Candidate):
    """``translate_batch`` on the source tokens of each fairseq batch, with fairseq's search options."""

    def __init__(self, peer: CTranslate2Peer, gen_cfg, beam: int):
        for option in ("sampling", "prefix_size", "match_source_len", "diverse_beam_groups", "unnormalized"):
            value = getattr(gen_cfg, option, None)
            if value and value not in (-1, False):
                raise ValueError(f"the CTranslate2 comparison does not support --{option.replace('_', '-')}")
        self.peer = peer
        self.gen_cfg = gen_cfg
        self.beam = beam
        inputs = peer.inputs
        self.src_dict, self.tgt_dict = inputs.src_dict, inputs.tgt_dict
        self.max_positions = min(model.max_decoder_positions() for model in inputs.models)

    def decode(self, batches) -> Dict[int, List[int]]:
        best = {}
        for sample in batches:
            best.update(translate_sample(
                self.peer.translator, sample, self.src_dict, self.tgt_dict, beam_size=self.beam,
                length_penalty=self.gen_cfg.lenpen, min_decoding_length=self.gen_cfg.min_len,
                max_decoding_length=self._max_len(sample["net_input"]["src_tokens"].size(1)),
                no_repeat_ngram_size=self.gen_cfg.no_repeat_ngram_size,
            ))
        return best

    def _max_len(self, src_len: int) -> int:
        return decoding_length_cap(self.gen_cfg, src_len, self.max_positions)
