"""The model, its generator and fairseq-interactive's pre- and post-processing, loaded once.

Each step is fairseq-interactive's (``fairseq_cli/interactive.py``): the task and the checkpoint loaded the same
way, the generator built by ``task.build_generator`` (so ``--decoder`` and every plugin option apply), a sentence
tokenized by ``encode_fn`` (``--tokenizer``, then ``--bpe``) and ``task.get_interactive_tokens_and_lengths``,
refused when longer than the model reads as fairseq's batching refuses it, and a hypothesis turned into its
``H-`` text (``utils.post_process_prediction``) and ``D-`` text (``decode_fn``) with its score in base 2.

Tokenizing and post-processing run on the server's event loop, the model only on the decoding thread
(``batching.py``).
"""

import ast
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy
import torch

from fairseq_fastgen.text_codec import decode_text, encode_text

logger = logging.getLogger("fairseq_fastgen.serve")


class SentenceTooLong(ValueError):
    """A sentence of a request is longer than the model reads or than the configured limit (413)."""


@dataclass
class Source:
    """One sentence of a request, tokenized: what enters the batch."""

    net_input: Dict[str, torch.Tensor]  # src_tokens (1, length) with eos, src_lengths (1,)
    src_str: str  # its source tokens as fairseq-interactive prints them (S- line): replace-unk reads it

    @property
    def length(self) -> int:
        return int(self.net_input["src_lengths"][0])


class Translator:
    def __init__(self, cfg, token_limits: Sequence[Tuple[str, int]] = ()):
        from fairseq import checkpoint_utils, tasks, utils

        utils.import_user_module(cfg.common)
        self.cfg = cfg
        self.use_cuda = torch.cuda.is_available() and not cfg.common.cpu
        self.task = task = tasks.setup_task(cfg.task)
        overrides = ast.literal_eval(cfg.common_eval.model_overrides)
        logger.info("loading model(s) from %s", cfg.common_eval.path)
        self.models, _ = checkpoint_utils.load_model_ensemble(
            utils.split_paths(cfg.common_eval.path), arg_overrides=overrides, task=task,
            suffix=cfg.checkpoint.checkpoint_suffix, strict=(cfg.checkpoint.checkpoint_shard_count == 1),
            num_shards=cfg.checkpoint.checkpoint_shard_count,
        )
        for model in self.models:
            if cfg.common.fp16:
                model.half()
            if self.use_cuda and not cfg.distributed_training.pipeline_model_parallel:
                model.cuda()
            model.prepare_for_inference_(cfg)
        self.src_dict, self.tgt_dict = task.source_dictionary, task.target_dictionary
        self.generator = task.build_generator(self.models, cfg.generation)
        self.tokenizer = task.build_tokenizer(cfg.tokenizer)
        self.bpe = task.build_bpe(cfg.bpe)
        self.align_dict = utils.load_align_dict(cfg.generation.replace_unk)
        self.max_positions = utils.resolve_max_positions(task.max_positions(),
                                                         *[model.max_positions() for model in self.models])
        self.token_limits = token_limits  # (option, tokens): --max-source-tokens, --max-tokens
        self.left_pad = getattr(cfg.task, "left_pad_source", True)
        from fairseq_cli.generate import get_symbols_to_strip_from_output

        self.strip_symbols = get_symbols_to_strip_from_output(self.generator)

    @property
    def device(self) -> str:
        return "cuda" if self.use_cuda else "cpu"

    # ---- fairseq-interactive's encode_fn and decode_fn ----------------------------------------------
    def encode_fn(self, text: str) -> str:
        return encode_text(text, self.tokenizer, self.bpe)

    def decode_fn(self, text: str) -> str:
        return decode_text(text, self.tokenizer, self.bpe)

    # ---- a request's sentences in -----------------------------------------------------------------
    def sources(self, texts: List[str]) -> List[Source]:
        """The sentences tokenized as fairseq-interactive's ``make_batches`` does; the first one longer than the
        model reads or than ``--max-source-tokens`` (or ``--max-tokens``) raises :class:`SentenceTooLong`, naming it
        and the limit."""
        from fairseq import utils

        texts = [text.strip() for text in texts]  # as fairseq-interactive's reader strips each line
        tokens, lengths = self.task.get_interactive_tokens_and_lengths(texts, self.encode_fn)
        dataset = self.task.build_dataset_for_inference(tokens, lengths)
        indices = numpy.arange(len(texts), dtype=numpy.int64)
        _, too_long = dataset.filter_indices_by_size(indices, self.max_positions)
        for index in sorted(int(i) for i in too_long):
            raise SentenceTooLong(f"sentence {index} has {lengths[index]} tokens (with eos), more than this model "
                                  f"reads (max positions {self.max_positions})")
        for index, length in enumerate(lengths):
            for option, limit in self.token_limits:
                if length > limit:
                    raise SentenceTooLong(f"sentence {index} has {length} tokens (with eos), more than {option} "
                                          f"{limit}")
        sources = []
        for index in range(len(texts)):
            net_input = dataset.collater([dataset[index]])["net_input"]
            src_tokens = utils.strip_pad(net_input["src_tokens"][0], self.tgt_dict.pad())
            src_str = self.src_dict.string(src_tokens, self.cfg.common_eval.post_process) if self.src_dict else ""
            sources.append(Source({"src_tokens": net_input["src_tokens"], "src_lengths": net_input["src_lengths"]},
                                  src_str))
        return sources

    def sample(self, sources: List[Source]) -> dict:
        """A fairseq sample of ``sources`` (one row each, padded to the longest as fairseq's collater pads)."""
        from fairseq.data import data_utils

        src_tokens = data_utils.collate_tokens([s.net_input["src_tokens"][0] for s in sources], self.src_dict.pad(),
                                               self.src_dict.eos(), left_pad=self.left_pad)  # (rows, longest)
        src_lengths = torch.cat([s.net_input["src_lengths"] for s in sources])  # (rows,)
        return {"net_input": {"src_tokens": src_tokens.to(self.device), "src_lengths": src_lengths.to(self.device)}}

    def warm_up(self, most_rows: int) -> List[int]:
        """Decode one short sentence in batches of 1, 2, 4, 8 and ``most_rows`` rows (up to ``most_rows``) before
        the server listens, so that the engine's units for those row counts are loaded (or compiled) now and not
        while the first requests wait; returns the batch sizes decoded."""
        source = self.sources(["warm up"])[0]
        sizes = sorted({n for n in (1, 2, 4, 8, most_rows) if 1 <= n <= most_rows})
        for size in sizes:
            self.task.inference_step(self.generator, self.models, self.sample([source] * size))
        return sizes

    # ---- hypotheses out -----------------------------------------------------------------------------
    def translation(self, source: Source, hypotheses: List[Dict[str, torch.Tensor]], nbest: int) -> dict:
        """One sentence's answer: its best hypothesis's ``D-`` text (``text``), ``H-`` text (``tokens``) and score
        in base 2 (``score``) as fairseq-interactive prints them; with ``nbest`` above 1 also ``nbest``, each of
        the first ``nbest`` hypotheses in that form."""
        answers = [self.hypothesis(source, hypothesis) for hypothesis in hypotheses[:nbest]]
        result = dict(answers[0]) if answers else {"text": "", "tokens": "", "score": None}
        if nbest > 1:
            result["nbest"] = answers
        return result

    def hypothesis(self, source: Source, hypothesis: Dict[str, torch.Tensor]) -> dict:
        from fairseq import utils

        _, hypo_str, _ = utils.post_process_prediction(
            hypo_tokens=hypothesis["tokens"].int().cpu(), src_str=source.src_str, alignment=hypothesis["alignment"],
            align_dict=self.align_dict, tgt_dict=self.tgt_dict, remove_bpe=self.cfg.common_eval.post_process,
            extra_symbols_to_ignore=self.strip_symbols,
        )
        score = float(hypothesis["score"] / math.log(2))  # base 2, as fairseq-interactive prints it
        return {"text": self.decode_fn(hypo_str), "tokens": hypo_str, "score": score}

    def partial_text(self, tokens: torch.Tensor) -> str:
        """The detokenized text of a hypothesis's first tokens (``tokens`` (length,)), for streamed answers."""
        text = self.tgt_dict.string(tokens.int().cpu(), self.cfg.common_eval.post_process,
                                    extra_symbols_to_ignore=self.strip_symbols)
        return self.decode_fn(text)
