"""What the one-process A/B scripts share (``*_ab.py``; not part of the product): the model and its test split on
one thread, ways of decoding timed in turn round after round, their medians.

Alternating the ways within each round makes a change in the machine's speed hit all of them alike; the first
round warms up (units loaded or compiled, buffers allocated) and is not timed.
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

import fairseq_fastgen  # noqa: F401  (plugin: --decoder, --step-engine, models)
from fairseq import checkpoint_utils


def load_test_split(data_bin: str, checkpoint: str):
    """(model, task): the checkpoint's model in eval mode, its task with the test split loaded, one torch thread."""
    torch.set_num_threads(1)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data_bin})
    task.load_dataset("test")
    return models[0].eval(), task


def timed_rounds(ways: Dict[str, Callable[[], List]], rounds: int) -> Tuple[Dict[str, List[float]], Dict[str, List]]:
    """Each way (a call returning its outputs) once per round, ``rounds`` timed rounds after a warm-up round:
    the seconds of each way's timed rounds, and its outputs of the last round."""
    seconds = {name: [] for name in ways}
    outputs = {}
    with torch.no_grad():
        for round_ in range(rounds + 1):
            for name, decode in ways.items():
                start = time.perf_counter()
                outputs[name] = decode()
                if round_:
                    seconds[name].append(time.perf_counter() - start)
    return seconds, outputs


def print_medians(seconds: Dict[str, List[float]], sentences: int) -> Dict[str, float]:
    """One line per way (its median, sentences/s, every round); returns the medians."""
    median = {name: statistics.median(values) for name, values in seconds.items()}
    for name, values in seconds.items():
        print(f"{name}: median {median[name]:.3f} s ({sentences / median[name]:.1f} sentences/s); rounds: "
              + ", ".join(f"{value:.3f}" for value in values))
    return median


def first_test_batches(task, batch_size: int, sentences: int) -> List:
    """fairseq's batches of ``batch_size`` test sentences (sorted by length), as many as hold ``sentences``."""
    batches = task.get_batch_iterator(task.dataset("test"), max_sentences=batch_size, disable_iterator_cache=True)
    return list(batches.next_epoch_itr(shuffle=False))[: max(1, sentences // batch_size)]


def best_tokens(generator, model, batches: List) -> List[List[int]]:
    """Each sentence's best hypothesis's tokens, batch after batch."""
    return [h[0]["tokens"].tolist() for sample in batches for h in generator.generate([model], sample)]


def decodes_after(switches: Dict[str, Callable[[], None]], generator, model, batches: List) -> Dict[str, Callable]:
    """Per way of ``timed_rounds``: a call that makes its switch, then decodes the batches (``best_tokens``)."""
    def decode_after(switch):
        def decode():
            switch()
            return best_tokens(generator, model, batches)
        return decode
    return {name: decode_after(switch) for name, switch in switches.items()}


def own_attribute(owner, name: str, value) -> None:
    """``name`` set on ``owner`` itself, over its class's; None: dropped, the class's own again."""
    vars(owner).pop(name, None)
    if value is not None:
        setattr(owner, name, value)


def print_way_against(seconds: Dict[str, List[float]], outputs: Dict[str, List], way: str, other: str, what: str):
    """The medians, then ``what``: ``other``'s median over ``way``'s (``way``'s speed-up), and how many sentences
    got the same tokens both ways."""
    median = print_medians(seconds, len(outputs[way]))
    same = sum(a == b for a, b in zip(outputs[way], outputs[other]))
    print(f"{what}: {median[other] / median[way]:.3f}x; the same tokens for {same} of {len(outputs[way])} sentences")


def ab_parser(doc: str, batch_size: int, sentences: int) -> argparse.ArgumentParser:
    """The A/B scripts' common arguments: DATA_BIN, CHECKPOINT, --batch-size, --sentences, --rounds, --max-len-b."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--sentences", type=int, default=sentences)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-len-b", type=int, default=200, help="outputs capped at this many tokens (an "
                        "untrained model's run to the cap)")
    return parser
