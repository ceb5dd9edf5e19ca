"""CTranslate2 behind fastgen-serve (``--peer ctranslate2``): the serving benchmark's peer, on the same server.

With ``--batching fixed`` the server's fixed batches are decoded by CTranslate2 instead of fairseq: the same
checkpoint converted once (``fairseq_fastgen.ctranslate2_model.convert``, cached), the same HTTP side,
queue, batching, tokenization and post-processing, so that a load curve compares the decoders alone.
CTranslate2 has no way to let sentences join a batch that is decoding, so it runs under fixed batches only.

:class:`CTranslate2Generator` stands where fairseq's generator stands (``task.inference_step`` calls its
``generate``): it hands the batch's source symbols to ``translate_batch`` with fairseq's search options (beam,
length penalty, minimum and maximum length, n-gram banning, ``--nbest``) and returns fairseq's hypotheses; a
hypothesis's ``score`` is CTranslate2's (its log-probability under CTranslate2's length normalization).
CTranslate2 computes in the precision matching ``--quantize`` (``int8``, ``bfloat16``), else the converted model's
float32.
"""

from typing import Dict, List

import torch

from fairseq_fastgen.ctranslate2_model import (CONVERSION_ERRORS, QUANTIZE_COMPUTE_TYPES, convert, decoding_length_cap,
                                               import_ctranslate2, source_symbols)
from fairseq_fastgen.option_checks import UsageError


class CTranslate2Generator:
    def __init__(self, cfg, translator):
        ctranslate2, note = import_ctranslate2()
        if ctranslate2 is None:
            raise UsageError(f"--peer ctranslate2: {note}")
        if translator.use_cuda:
            raise UsageError("--peer ctranslate2 runs on the CPU here: add --cpu")
        if len(translator.models) != 1:
            raise UsageError("--peer ctranslate2 converts one checkpoint, not an ensemble")
        task, generation = cfg.task, cfg.generation
        try:
            model_dir = convert(ctranslate2, cfg.common_eval.path, task.data.split(":")[0],
                                getattr(task, "source_lang", None), getattr(task, "target_lang", None))
        except CONVERSION_ERRORS as error:
            raise UsageError(f"--peer ctranslate2 could not convert {cfg.common_eval.path}: {error}") from None
        compute_type = QUANTIZE_COMPUTE_TYPES.get(str(getattr(generation, "quantize", None)), "default")
        self.translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                                 intra_threads=torch.get_num_threads())
        self.src_dict, self.tgt_dict = translator.src_dict, translator.tgt_dict
        self.max_positions = min(model.max_decoder_positions() for model in translator.models)
        self.generation = generation
        self.search = dict(beam_size=generation.beam, num_hypotheses=generation.nbest,
                           length_penalty=generation.lenpen, min_decoding_length=generation.min_len,
                           no_repeat_ngram_size=generation.no_repeat_ngram_size, return_scores=True)

    def generate(self, models, sample, **unused) -> List[List[Dict[str, torch.Tensor]]]:
        """fairseq's hypotheses of one batch (``sample["net_input"]["src_tokens"]`` (sentences, source length))."""
        src_tokens = sample["net_input"]["src_tokens"]  # (sentences, source length), eos included
        longest = decoding_length_cap(self.generation, src_tokens.size(1), self.max_positions)
        results = self.translator.translate_batch(source_symbols(src_tokens, self.src_dict), max_batch_size=0,
                                                  max_decoding_length=longest, **self.search)
        eos = self.tgt_dict.eos()
        return [[self.hypothesis([self.tgt_dict.index(s) for s in symbols] + [eos], score)
                 for symbols, score in zip(result.hypotheses, result.scores)] for result in results]

    @staticmethod
    def hypothesis(tokens: List[int], score: float) -> Dict[str, torch.Tensor]:
        return {"tokens": torch.tensor(tokens), "score": torch.tensor(score), "alignment": None,
                "positional_scores": torch.full((len(tokens),), score)}
