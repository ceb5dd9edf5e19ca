"""random_subloss: each head's loss equals stock label smoothing on its shifted
targets; random mode trains one head per minibatch, mean mode all of them."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fairseq_fastgen  # noqa: F401  (registers model and criterion)
from fairseq import metrics
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq_fastgen.criterions.random_subloss import RandomSublossCriterion, shifted_target
from tests.models.khead_toy import build_in_process, randomized_heads

BLOCK = 3
SMOOTHING = 0.1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def khead(toy_model):
    """An untrained 3-head toy model (head layer randomized) and a validation batch."""
    model, task = randomized_heads(toy_model.data_bin, BLOCK)
    task.load_dataset("valid")
    batches = task.get_batch_iterator(dataset=task.dataset("valid"), max_sentences=8).next_epoch_itr(shuffle=False)
    return model, task, next(iter(batches))


def criterion(task, mode):
    return RandomSublossCriterion(task, label_smoothing=SMOOTHING, subloss_mode=mode, sentence_avg=False)


class OneHead(nn.Module):
    """The model seen through one head: its logits as the model output."""

    def __init__(self, model, head):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, **net_input):
        _, extra = self.model(**net_input)
        return self.model.decoder.output_layer(extra["khead_features"][:, :, self.head]), extra

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return self.model.get_normalized_probs(net_output, log_probs, sample)

    def get_targets(self, sample, net_output):
        return sample["target"]


def shifted_by_hand(target, head, pad):
    """Each row's real tokens from position ``head`` on, padded to the same width."""
    rows = []
    for row in target.tolist():
        real = [t for t in row if t != pad]
        rows.append(real[head:] + [pad] * (len(row) - len(real[head:])))
    return torch.tensor(rows)


def test_shifted_target_pads_past_the_end():
    pad = 1
    target = torch.tensor([[5, 6, 7, 2, 1], [8, 2, 1, 1, 1]])
    assert shifted_target(target, 0, pad).tolist() == target.tolist()
    assert shifted_target(target, 1, pad).tolist() == [[6, 7, 2, 1, 1], [2, 1, 1, 1, 1]]
    assert shifted_target(target, 2, pad).tolist() == [[7, 2, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert shifted_target(target, 6, pad).tolist() == [[1] * 5] * 2


@torch.no_grad()
def test_every_head_loss_is_stock_label_smoothing_on_its_shifted_target(khead):
    model, task, sample = khead
    model.eval()
    _, _, logged = criterion(task, "mean").eval()(model, sample)
    stock = LabelSmoothedCrossEntropyCriterion(
        task, sentence_avg=False, label_smoothing=SMOOTHING, report_accuracy=True
    )
    pad = task.target_dictionary.pad()
    for head in range(BLOCK):
        shifted = dict(sample, target=shifted_by_hand(sample["target"], head, pad))
        loss, _, expected = stock(OneHead(model, head), shifted)
        assert math.isclose(float(logged[f"loss_h{head + 1}"]), float(loss), rel_tol=1e-5)
        assert logged[f"correct_h{head + 1}"] == int(expected["n_correct"])
        assert logged[f"ntokens_h{head + 1}"] == int(expected["total"])
    assert logged["ntokens_h1"] > logged["ntokens_h2"] > logged["ntokens_h3"]  # later heads: fewer targets


def per_head_losses(logged):
    return [float(logged[f"loss_h{head + 1}"]) for head in range(BLOCK)]


def test_random_mode_trains_one_head_per_minibatch_and_validates_the_mean(khead):
    model, task, sample = khead
    model.eval()  # no dropout: the chosen head's loss must equal the one validation computes
    with torch.no_grad():
        _, _, validated = criterion(task, "mean").eval()(model, sample)
    chosen = set()
    random_mode = criterion(task, "random").train()
    for seed in range(30):  # until every head was chosen
        if chosen == set(range(BLOCK)):
            break
        torch.manual_seed(seed)
        loss, _, logged = random_mode(model, sample)
        trained = [head for head in range(BLOCK) if logged[f"ntokens_h{head + 1}"] > 0]
        assert len(trained) == 1  # one head projected and logged per training minibatch
        head = trained[0]
        assert math.isclose(float(loss), float(validated[f"loss_h{head + 1}"]), rel_tol=1e-5)
        assert logged[f"correct_h{head + 1}"] == validated[f"correct_h{head + 1}"]
        chosen.add(head)
    assert chosen == set(range(BLOCK))

    with torch.no_grad():
        for mode in ("random", "mean"):
            loss, _, logged = criterion(task, mode).eval()(model, sample)
            assert math.isclose(float(loss), sum(per_head_losses(logged)) / BLOCK, rel_tol=1e-6)


def test_random_mode_reaches_every_parameter(khead):
    """Data parallel training needs a gradient for every trained parameter at every step."""
    model, task, sample = khead
    model.train()
    model.zero_grad()
    loss, _, _ = criterion(task, "random").train()(model, sample)
    loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
    model.zero_grad()


def test_frozen_identity_head_is_never_chosen(toy_model):
    model, task = build_in_process(toy_model.data_bin, "--block-size", "3", "--khead-identity-first", "--freeze-base")
    assert model.decoder.trainable_heads() == [1, 2]
    unfrozen, _ = build_in_process(toy_model.data_bin, "--block-size", "3", "--khead-identity-first")
    assert unfrozen.decoder.trainable_heads() == [0, 1, 2]


def reduced(logs):
    """What fairseq's meters show of ``logs`` after the criterion's reduce_metrics."""
    with metrics.aggregate() as aggregated:
        RandomSublossCriterion.reduce_metrics(logs)
    return aggregated.get_smoothed_values()


def test_logged_metrics_name_every_head():
    logs = [
        {"loss": 6.0, "nll_loss": 5.0, "ntokens": 10, "sample_size": 10, "nsentences": 2,
         "loss_h1": 4.0, "ntokens_h1": 10, "correct_h1": 5, "loss_h2": 8.0, "ntokens_h2": 8, "correct_h2": 1},
        {"loss": 3.0, "nll_loss": 2.0, "ntokens": 5, "sample_size": 5, "nsentences": 1,
         "loss_h1": 2.0, "ntokens_h1": 5, "correct_h1": 4, "loss_h2": 4.0, "ntokens_h2": 4, "correct_h2": 3},
    ]
    values = reduced(logs)
    assert values["acc_h1"] == pytest.approx(100 * 9 / 15, abs=0.01)
    assert values["acc_h2"] == pytest.approx(100 * 4 / 12, abs=0.01)
    assert values["loss_h2"] == pytest.approx(12 / 12 / math.log(2), abs=1e-3)
    assert values["loss"] == pytest.approx(9 / 15 / math.log(2), abs=1e-3)


@pytest.mark.parametrize("smoothing, shown", [(math.nan, "nan"), (math.inf, "inf"), (-0.1, "-0.1"), (1.5, "1.5")])
def test_label_smoothing_out_of_range_is_refused(smoothing, shown):
    """A NaN epsilon would make every loss NaN."""
    task = SimpleNamespace(target_dictionary=None)
    with pytest.raises(ValueError) as refusal:
        RandomSublossCriterion(task, label_smoothing=smoothing, subloss_mode="random", sentence_avg=False)
    assert str(refusal.value) == f"--label-smoothing must be a finite number in [0, 1], got {shown}"
    assert RandomSublossCriterion(task, label_smoothing=0.1, subloss_mode="mean", sentence_avg=False).epsilon == 0.1


def write_token_list(path, dictionary, tokens):
    path.write_text("".join(f"{dictionary[token]} 1\n" for token in tokens), encoding="utf-8")
    return str(path)


class OneListedHead(OneHead):
    """One head seen through the listed tokens only: the columns of its full logits that the list holds, and its
    targets as positions in the list (a target left out becomes the list's position of pad)."""

    def __init__(self, model, head, listed, pad):
        super().__init__(model, head)
        self.listed, self.pad = listed, pad

    def forward(self, **net_input):
        logits, extra = super().forward(**net_input)
        return logits[:, :, self.listed], extra

    def get_targets(self, sample, net_output):
        position = {int(token): index for index, token in enumerate(self.listed)}
        return torch.tensor([[position.get(token, position[self.pad]) for token in row]
                             for row in sample["target"].tolist()])


@torch.no_grad()
def test_a_list_of_every_token_changes_no_head(khead, tmp_path):
    model, task, sample = khead
    model.eval()
    dictionary = task.target_dictionary
    every = write_token_list(tmp_path / "every.txt", dictionary, range(dictionary.nspecial, len(dictionary)))
    _, _, plain = criterion(task, "mean").eval()(model, sample)
    _, _, listed = RandomSublossCriterion(task, SMOOTHING, "mean", False, proposal_vocab=every).eval()(model, sample)
    for head in range(1, BLOCK + 1):
        assert math.isclose(float(listed[f"loss_h{head}"]), float(plain[f"loss_h{head}"]), rel_tol=1e-5)
        for count in ("correct", "ntokens", "targets"):
            assert listed[f"{count}_h{head}"] == plain[f"{count}_h{head}"]


@torch.no_grad()
def test_listed_heads_choose_among_the_list_and_head_1_among_every_token(khead, tmp_path):
    model, task, sample = khead
    model.eval()
    dictionary, pad = task.target_dictionary, task.target_dictionary.pad()
    in_targets = sorted(set(sample["target"].flatten().tolist()) - set(range(dictionary.nspecial)))
    kept = in_targets[::2] + list(range(len(dictionary) - 50, len(dictionary)))  # half the targets, 50 others
    path = write_token_list(tmp_path / "half.txt", dictionary, kept)
    listed = torch.tensor(sorted(set(kept) | set(range(dictionary.nspecial))))
    _, _, logged = RandomSublossCriterion(task, SMOOTHING, "mean", False, proposal_vocab=path).eval()(model, sample)
    _, _, plain = criterion(task, "mean").eval()(model, sample)
    assert math.isclose(float(logged["loss_h1"]), float(plain["loss_h1"]), rel_tol=1e-6)
    stock = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=SMOOTHING,
                                               report_accuracy=True)
    for head in range(1, BLOCK):
        shifted = dict(sample, target=shifted_by_hand(sample["target"], head, pad))
        loss, _, expected = stock(OneListedHead(model, head, listed, pad), shifted)
        assert math.isclose(float(logged[f"loss_h{head + 1}"]), float(loss), rel_tol=1e-5)
        assert logged[f"correct_h{head + 1}"] == int(expected["n_correct"])
        assert logged[f"ntokens_h{head + 1}"] == int(expected["total"])  # the listed targets
        assert logged[f"targets_h{head + 1}"] == int(shifted["target"].ne(pad).sum())  # every target
        assert logged[f"ntokens_h{head + 1}"] < logged[f"targets_h{head + 1}"]


def test_accuracy_counts_every_target_and_loss_the_listed_ones():
    values = reduced([{"loss": 3.0, "nll_loss": 2.0, "ntokens": 10, "sample_size": 10, "nsentences": 2,
                       "loss_h1": 4.0, "ntokens_h1": 10, "targets_h1": 10, "correct_h1": 5,
                       "loss_h2": 6.0, "ntokens_h2": 6, "targets_h2": 8, "correct_h2": 2}])
    assert values["acc_h1"] == pytest.approx(100 * 5 / 10, abs=0.01)
    assert values["acc_h2"] == pytest.approx(100 * 2 / 8, abs=0.01)
    assert values["loss_h2"] == pytest.approx(6 / 6 / math.log(2), abs=1e-3)


def test_a_list_naming_an_unknown_token_is_refused_in_one_line(khead, tmp_path):
    _, task, _ = khead
    path = tmp_path / "list.txt"
    path.write_text("no-such-token-here 3\n", encoding="utf-8")
    with pytest.raises(ValueError) as refusal:
        RandomSublossCriterion(task, SMOOTHING, "mean", False, proposal_vocab=str(path))
    assert str(refusal.value) == (f"--proposal-vocab {path}, line 1: 'no-such-token-here' is not a token of the "
                                  f"model's target dictionary")
    with pytest.raises(ValueError, match="cannot be read"):
        RandomSublossCriterion(task, SMOOTHING, "mean", False, proposal_vocab=str(tmp_path / "missing.txt"))


@torch.no_grad()
def test_first_head_weight_shares_the_loss_between_head_1_and_the_others(khead):
    model, task, sample = khead
    model.eval()
    for weight in (0.5, 0.9, 1 / BLOCK):
        loss, _, logged = RandomSublossCriterion(task, SMOOTHING, "mean", False, first_head_weight=weight).eval()(
            model, sample)
        heads = per_head_losses(logged)
        assert math.isclose(float(loss), weight * heads[0] + (1 - weight) * sum(heads[1:]) / (BLOCK - 1),
                            rel_tol=1e-6)
    assert math.isclose(float(loss), sum(heads) / BLOCK, rel_tol=1e-6)  # 1/k: the plain mean


@pytest.mark.parametrize("mode, weight, message", [
    ("random", 0.5, "--first-head-weight applies to --subloss-mode mean (random mode trains one head a minibatch)"),
    ("mean", 1.5, "--first-head-weight must be a finite number in [0, 1], got 1.5"),
])
def test_first_head_weight_misuse_is_refused_in_one_line(mode, weight, message):
    task = SimpleNamespace(target_dictionary=None)
    with pytest.raises(ValueError) as refusal:
        RandomSublossCriterion(task, SMOOTHING, mode, False, first_head_weight=weight)
    assert str(refusal.value) == message
