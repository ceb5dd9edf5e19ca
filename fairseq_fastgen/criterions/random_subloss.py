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

``--first-head-weight W`` (mean mode) gives head 1, the model's own
prediction, the share W of the loss and the other heads 1 - W between them.

With ``--proposal-vocab FILE`` heads 2..k choose among the file's tokens only
(what ``--blockwise-proposal-vocab`` lets them propose when decoding): their
softmax spans those rows of the output projection, so at a large vocabulary
each of them costs a fraction of a full projection (mean mode at k = 8 and
32k tokens: 7 of the 8 projections shrink to a list of 4,000).  Head 1 keeps
the whole vocabulary.  A target outside the list counts for nothing in those
heads' loss and as a miss in their accuracy.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import II

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_fastgen.option_checks import require_finite_in_range
from fairseq_fastgen.refusals import UsageError
from fairseq_fastgen.token_lists import listed_tokens


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
    proposal_vocab: Optional[str] = field(
        default=None,
        metadata={"help": "heads 2..k learn to choose among this file's tokens only (fairseq's dictionary format, "
                          "as --blockwise-proposal-vocab reads it; the special symbols always count): their softmax "
                          "spans those rows of the output projection, a fraction of a large vocabulary's cost. "
                          "Decode the student with the same file as --blockwise-proposal-vocab (its heads never "
                          "learn to rank the other tokens); head 1 keeps the whole vocabulary"},
    )
    first_head_weight: Optional[float] = field(
        default=None,
        metadata={"help": "mean mode: head 1's share of the loss, the other heads sharing the rest equally "
                          "(default: 1/k, the plain mean). Head 1 is the model's own prediction, the tokens greedy "
                          "and exact blockwise decoding emit: fine-tuned at k = 8 with a share of 1/8 the base "
                          "lost 6 BLEU on Multi30k in 220 updates"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")


@register_criterion("random_subloss", dataclass=RandomSublossConfig)
class RandomSublossCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing, subloss_mode, sentence_avg, proposal_vocab=None, first_head_weight=None):
        super().__init__(task)
        self.epsilon = require_finite_in_range("--label-smoothing", label_smoothing, 0, 1, error=UsageError)
        self.mode = str(subloss_mode)
        self.first_head_weight = None
        if first_head_weight is not None:
            if self.mode != "mean":
                raise UsageError("--first-head-weight applies to --subloss-mode mean (random mode trains one head "
                                 "a minibatch)")
            self.first_head_weight = require_finite_in_range("--first-head-weight", first_head_weight, 0, 1,
                                                             error=UsageError)
        self.sentence_avg = sentence_avg
        self.listed = None  # (N,) the tokens heads 2..k choose among, ascending; None: every token
        if proposal_vocab:
            try:
                self.listed = listed_tokens(proposal_vocab, task.target_dictionary, "--proposal-vocab")
            except ValueError as error:
                raise UsageError(str(error)) from None
            # (vocab,) each token's position in the list, -1: not listed.  The special symbols lead the ascending
            # list, so pad's position is pad's own index: a listed head ignores the same index as the others
            self.list_position = torch.full((len(task.target_dictionary),), -1, dtype=torch.long)
            self.list_position[self.listed] = torch.arange(len(self.listed))

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
        if self.listed is not None and self.listed.device != target.device:  # moved once, not every head
            self.listed, self.list_position = self.listed.to(target.device), self.list_position.to(target.device)
        for head in range(block_size):
            if chosen is not None and head != chosen:
                logging_output.update({f"loss_h{head + 1}": zero, f"ntokens_h{head + 1}": 0, f"correct_h{head + 1}": 0,
                                       f"targets_h{head + 1}": 0})
                continue
            head_target = shifted_target(target, head, self.padding_idx)
            real = head_target.ne(self.padding_idx)
            logits, loss_target, tokens = self.head_scores(model, first_logits, features, head, head_target)
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)  # (batch, len, vocab or N)
            loss, nll_loss = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), loss_target.view(-1), self.epsilon, ignore_index=self.padding_idx
            )
            losses.append(loss)
            nll_losses.append(nll_loss)
            logging_output[f"loss_h{head + 1}"] = loss.data
            logging_output[f"ntokens_h{head + 1}"] = int(loss_target.ne(self.padding_idx).sum())
            logging_output[f"targets_h{head + 1}"] = int(real.sum())
            best = lprobs.argmax(dim=-1)  # (batch, len)
            best = best if tokens is None else tokens[best]  # token ids
            logging_output[f"correct_h{head + 1}"] = int((best.eq(head_target) & real).sum())

        loss, nll_loss = self.combined(losses), self.combined(nll_losses)
        if chosen is not None:  # the other heads' parameters join the graph with gradient zero
            loss = loss + 0.0 * features.sum()
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output.update(
            loss=loss.data, nll_loss=nll_loss.data, ntokens=sample["ntokens"],
            nsentences=sample["target"].size(0), sample_size=sample_size,
        )
        return loss, sample_size, logging_output

    def combined(self, losses):
        """The minimized loss of the heads' ``losses`` (one each, or the chosen head's alone in random mode)."""
        losses = torch.stack(losses)  # (heads,)
        if self.first_head_weight is None or len(losses) < 2:
            return losses.mean()
        return self.first_head_weight * losses[0] + (1 - self.first_head_weight) * losses[1:].mean()

    def head_scores(self, model, first_logits, features, head, head_target):
        """What head ``head`` is scored on: its logits (batch, len, V), its targets as indices of their last
        dimension (batch, len; pad: counts for nothing), and the token (V,) each index stands for (None: index =
        token).  V is the vocabulary, or under --proposal-vocab the listed tokens for heads 2..k."""
        if head == 0:
            return first_logits, head_target, None
        if self.listed is None:
            return model.decoder.output_layer(features[:, :, head]), head_target, None
        rows = model.decoder.output_projection.weight.index_select(0, self.listed)  # (N, dim)
        logits = F.linear(features[:, :, head], rows)  # (batch, len, N)
        position = self.list_position[head_target]  # (batch, len), -1: not listed
        return logits, position.masked_fill(position.lt(0), self.padding_idx), self.listed

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
                head_targets = total(f"targets_h{head}") or head_tokens  # every real target, listed or not
                head_accuracy = 100.0 * total(f"correct_h{head}") / head_targets
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
