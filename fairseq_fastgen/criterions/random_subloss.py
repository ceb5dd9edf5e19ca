"""``random_subloss``: the training loss of a ``transformer_khead`` model.

Head i predicts the token i - 1 positions after the one head 1 predicts, so its
target is the usual target shifted left by i - 1; positions past the end of a
sentence become padding and count for nothing.  Each head's loss is label
smoothed as in ``label_smoothed_cross_entropy``.

The minimized loss is, per minibatch, one head's loss chosen uniformly at random
(``--subloss-mode random``, Stern et al.'s unbiased estimate of the mean) or
the mean over the heads (``--subloss-mode mean``).  In random mode only the
chosen head is projected onto the vocabulary (the projection is most of a
k-head model's training cost), and ``loss_h<i>`` / ``acc_h<i>`` of training
average each head over the minibatches that trained it; every head's features
still enter the loss with weight zero, so every parameter is part of the graph
(data parallel training needs that).  Validation always projects every head and
reports the mean, plus ``loss_h<i>`` / ``acc_h<i>`` for every head.
"""

import math
from dataclasses import dataclass, field

import torch
from omegaconf import II

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_fastgen.option_checks import require_finite_in_range
from fairseq_fastgen.refusals import UsageError


@dataclass
class RandomSublossConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "epsilon for label smoothing of every head's loss, 0 means no label smoothing"},
    )
    subloss_mode: ChoiceEnum(["random", "mean"]) = field(
        default="random",
        metadata={"help": "random: each minibatch trains one head's loss, chosen uniformly at random; "
                          "mean: the mean of all heads' losses"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")


@register_criterion("random_subloss", dataclass=RandomSublossConfig)
class RandomSublossCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing, subloss_mode, sentence_avg):
        super().__init__(task)
        self.epsilon = require_finite_in_range("--label-smoothing", label_smoothing, 0, 1, error=UsageError)
        self.mode = str(subloss_mode)
        self.sentence_avg = sentence_avg

    def forward(self, model, sample, reduce=True):
        first_logits, extra = model(**sample["net_input"])  # (batch, tgt_len, vocab)
        features = extra.get("khead_features") if isinstance(extra, dict) else None
        if features is None:
            raise UsageError("--criterion random_subloss needs a k-head model (--arch transformer_khead)")
        target = model.get_targets(sample, (first_logits, extra))  # (batch, tgt_len)
        block_size = features.size(2)  # features: (batch, tgt_len, k, dim)
        chosen = self.chosen_head(model) if self.training and self.mode == "random" else None
        losses, nll_losses, logging_output = [], [], {}
        zero = torch.zeros((), device=target.device)  # logged for the heads this minibatch does not train
        for head in range(block_size):
            if chosen is not None and head != chosen:
                logging_output.update({f"loss_h{head + 1}": zero, f"ntokens_h{head + 1}": 0, f"correct_h{head + 1}": 0})
                continue
            head_target = shifted_target(target, head, self.padding_idx)
            logits = first_logits if head == 0 else model.decoder.output_layer(features[:, :, head])
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)  # (batch, len, vocab)
            loss, nll_loss = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), head_target.view(-1), self.epsilon, ignore_index=self.padding_idx
            )
            real = head_target.ne(self.padding_idx)
            losses.append(loss)
            nll_losses.append(nll_loss)
            logging_output[f"loss_h{head + 1}"] = loss.data
            logging_output[f"ntokens_h{head + 1}"] = int(real.sum())
            logging_output[f"correct_h{head + 1}"] = int((lprobs.argmax(dim=-1).eq(head_target) & real).sum())

        loss = torch.stack(losses).mean()
        nll_loss = torch.stack(nll_losses).mean()
        if chosen is not None:  # the other heads' parameters join the graph with gradient zero
            loss = loss + 0.0 * features.sum()
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output.update(
            loss=loss.data, nll_loss=nll_loss.data, ntokens=sample["ntokens"],
            nsentences=sample["target"].size(0), sample_size=sample_size,
        )
        return loss, sample_size, logging_output

    @staticmethod
    def chosen_head(model) -> int:
        """A head chosen uniformly among those whose output depends on a trained parameter."""
        candidates = model.decoder.trainable_heads()
        return candidates[int(torch.randint(len(candidates), ()))]

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        ntokens = total("ntokens")
        metrics.log_scalar("loss", total("loss") / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        head = 1
        while logging_outputs and f"loss_h{head}" in logging_outputs[0]:
            head_tokens = total(f"ntokens_h{head}")
            if head_tokens > 0:
                head_loss = total(f"loss_h{head}") / head_tokens / math.log(2)
                metrics.log_scalar(f"loss_h{head}", head_loss, head_tokens, round=3)
                head_accuracy = 100.0 * total(f"correct_h{head}") / head_tokens
                metrics.log_scalar(f"acc_h{head}", head_accuracy, head_tokens, round=2)
            head += 1

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def shifted_target(target, head, pad):
    """Target of head ``head`` (0-based): ``target`` shifted left by ``head``, pad after the end."""
    if head == 0:
        return target
    shifted = torch.full_like(target, pad)
    shifted[:, :-head] = target[:, head:]
    return shifted.masked_fill(target.eq(pad), pad)
