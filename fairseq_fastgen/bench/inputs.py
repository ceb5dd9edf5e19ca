"""What every configuration shares: the task, the models, the sentences and their batches.

Models are loaded once and the test sentences are chosen once; the batches of
each batching (batch size / max tokens) are collated once and reused by every
decoder that batches that way, so all configurations decode the same inputs.
"""

import ast
import logging
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from fairseq import checkpoint_utils, tasks, utils

logger = logging.getLogger("fastgen_bench")


class BenchInputs:
    def __init__(self, cfg, khead_path: Optional[str] = None, max_sentences: Optional[int] = None):
        self.cfg = cfg
        utils.import_user_module(cfg.common)
        if cfg.common.seed is not None:
            np.random.seed(cfg.common.seed)
            utils.set_torch_seed(cfg.common.seed)
        self.use_cuda = torch.cuda.is_available() and not cfg.common.cpu
        self.task = tasks.setup_task(cfg.task)
        self.models, saved_cfg = self._load_models(cfg.common_eval.path)
        self.khead_models = self._load_models(khead_path)[0] if khead_path else None
        self.task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)
        self.dataset = self.task.dataset(cfg.dataset.gen_subset)
        self.src_dict = self.task.source_dictionary
        self.tgt_dict = self.task.target_dictionary
        self.tokenizer = self.task.build_tokenizer(cfg.tokenizer)
        self.bpe = self.task.build_bpe(cfg.bpe)
        self.sentence_ids = self._select_sentences(max_sentences)  # (sentences,) dataset indices, by length
        self.references = self._references()  # sentence id -> detokenized target, None without targets
        self._batches: Dict[Tuple, List[dict]] = {}

    def _load_models(self, path):
        cfg = self.cfg
        logger.info("loading model(s) from %s", path)
        models, saved_cfg = checkpoint_utils.load_model_ensemble(
            utils.split_paths(path),
            arg_overrides=ast.literal_eval(cfg.common_eval.model_overrides),
            task=self.task,
            suffix=cfg.checkpoint.checkpoint_suffix,
            strict=cfg.checkpoint.checkpoint_shard_count == 1,
            num_shards=cfg.checkpoint.checkpoint_shard_count,
        )
        for model in models:
            if cfg.common.fp16:
                model.half()
            if self.use_cuda:
                model.cuda()
            model.prepare_for_inference_(cfg)
        return models, saved_cfg

    def _select_sentences(self, max_sentences):
        """The sentences fairseq-generate would decode (in its length order), ids below ``max_sentences``."""
        indices = self.dataset.ordered_indices()
        if max_sentences is not None:
            indices = indices[indices < max_sentences]
        all_models = self.models + (self.khead_models or [])
        max_positions = utils.resolve_max_positions(self.task.max_positions(), *[m.max_positions() for m in all_models])
        indices, ignored = self.dataset.filter_indices_by_size(indices, max_positions)
        if len(ignored):
            logger.warning("%d sentences are longer than the models accept and are left out", len(ignored))
        if len(indices) == 0:
            raise ValueError(f"no sentences to decode in subset {self.cfg.dataset.gen_subset!r}")
        return indices

    def batches(self, dataset_cfg) -> List[dict]:
        """Collated samples of every selected sentence, batched as ``dataset_cfg`` says (cached)."""
        key = (dataset_cfg.batch_size, dataset_cfg.max_tokens, dataset_cfg.required_batch_size_multiple)
        if key not in self._batches:
            index_batches = self.dataset.batch_by_size(
                self.sentence_ids, max_tokens=key[1], max_sentences=key[0], required_batch_size_multiple=key[2]
            )
            samples = [self.dataset.collater([self.dataset[int(i)] for i in batch]) for batch in index_batches]
            self._batches[key] = [utils.move_to_cuda(s) if self.use_cuda else s for s in samples]
        return self._batches[key]

    # ---- text -----------------------------------------------------------------------------
    def detokenize(self, tokens, escape_unk=False) -> str:
        """Tokens (eos allowed) -> text as fairseq-generate prints it after detokenization (D- lines)."""
        text = self.tgt_dict.string(
            tokens, self.cfg.common_eval.post_process, escape_unk=escape_unk,
            extra_symbols_to_ignore={self.tgt_dict.eos()},
        )
        if self.bpe is not None:
            text = self.bpe.decode(text)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(text)
        return text

    def _references(self) -> Optional[Dict[int, str]]:
        targets = {int(i): self.dataset[int(i)]["target"] for i in self.sentence_ids}
        if any(target is None for target in targets.values()):
            return None
        return {i: self.detokenize(target, escape_unk=True) for i, target in targets.items()}
