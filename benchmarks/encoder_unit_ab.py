"""Greedy decoding on --step-engine compiled with and without the encoder's compiled unit, in one process (not part
of the product).

    python benchmarks/encoder_unit_ab.py DATA_BIN CHECKPOINT [--batch-size 1] [--sentences 300] [--rounds 3]

Decodes the first ``--sentences`` sentences of the test split in batches of ``--batch-size`` with one generator
(``--step-engine compiled --compiled-freezing``, one thread), its runner's encoder unit
(``CompiledRunner.encoder_pass``) switched on and off in turn for ``--rounds`` timed rounds after a warm-up round,
so a change in the machine's speed hits both alike. Prints the seconds of each round, the medians, their ratio,
and how many sentences got the same tokens both ways. Set ``FASTGEN_COMPILED_DIR`` to keep the units between
runs (the warm-up round compiles what is missing).
"""

import argparse
import statistics
import time

import torch

import fairseq_fastgen  # noqa: F401  (plugin: --decoder, --step-engine)
from fairseq import checkpoint_utils, tasks
from fairseq.dataclass.configs import GenerationConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    models, saved, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.checkpoint], arg_overrides={"data": args.data_bin})
    model = models[0].eval()
    task.load_dataset("test")
    batches = list(task.get_batch_iterator(
        task.dataset("test"), max_sentences=args.batch_size, disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=False))[: max(1, args.sentences // args.batch_size)]
    generator = task.build_generator([model], GenerationConfig(
        beam=1, decoder="greedy", step_engine="compiled", compiled_freezing=True))
    runner = generator.runner
    encoder_pass = runner.encoder_pass
    if encoder_pass is None:
        raise SystemExit("this runner has no encoder unit (not on the CPU with oneDNN, or an encoder it cannot serve)")
    seconds = {"encoder unit": [], "fairseq's encoder": []}
    tokens = {}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):
            for name in seconds:
                runner.encoder_pass = encoder_pass if name == "encoder unit" else None
                start = time.perf_counter()
                tokens[name] = [h[0]["tokens"].tolist() for sample in batches for h in generator.generate([model], sample)]
                if round_:  # the first round is the warm-up
                    seconds[name].append(time.perf_counter() - start)
    for name, values in seconds.items():
        print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} s, median {statistics.median(values):.2f} s")
    ratio = statistics.median(seconds["fairseq's encoder"]) / statistics.median(seconds["encoder unit"])
    same = sum(a == b for a, b in zip(*tokens.values()))
    print(f"with the encoder unit: {ratio:.2f}x; the same tokens for {same} of {len(tokens['encoder unit'])} sentences")


if __name__ == "__main__":
    main()
