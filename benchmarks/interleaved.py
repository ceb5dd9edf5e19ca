"""What the one-process A/B scripts share (``*_ab.py``; not part of the product): the model and its test split on
one thread, ways of decoding timed in turn round after round, their medians.

Alternating the ways within each round makes a change in the machine's speed hit all of them alike; the first
round warms up (units loaded or compiled, buffers allocated) and is not timed.
"""

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
