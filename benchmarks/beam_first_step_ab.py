"""Stock beam search on --step-engine compiled with its first step at one row per sentence, and at every beam's row,
in one process (not part of the product).

    python benchmarks/beam_first_step_ab.py DATA_BIN CHECKPOINT [--beam 5] [--batch-size 64] [--sentences 128]
        [--rounds 3] [--max-len-b 25] [--quantize int8]

Every beam of a sentence starts from the same bos, so the compiled engine runs a beam search's first step once per
sentence and copies its keys and outputs to the beams (``CompiledRunner.first_step_of_beams``; CTranslate2 starts
alike). Above the row buckets with the unit for many rows (the default with AVX-512) that step is eager; before, the
unit ran every beam's row there. This decodes the first ``--sentences`` test sentences with one generator
(``--step-engine compiled --compiled-freezing``, one thread), the runner's rule switched between the two in turn for
``--rounds`` timed rounds after a warm-up round. Prints the seconds of each round, the medians, their ratio, and how
many sentences got the same tokens both ways. Set ``FASTGEN_COMPILED_DIR`` to keep the units between runs.
"""

# first: it loads the plugin, whose options fairseq's GenerationConfig then has
from interleaved import (ab_parser, decodes_after, first_test_batches, load_test_split,  # (benchmarks/, the
                         own_attribute, print_way_against, timed_rounds)  # A/B scripts' own)
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402


def main():
    parser = ab_parser(__doc__, batch_size=64, sentences=128)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--quantize", help="the units' precision (int8: the eager first step runs the int8 layers)")
    args = parser.parse_args()
    model, task = load_test_split(args.data_bin, args.checkpoint)
    batches = first_test_batches(task, args.batch_size, args.sentences)
    generator = task.build_generator([model], GenerationConfig(
        beam=args.beam, decoder="beam", step_engine="compiled", compiled_freezing=True, quantize=args.quantize,
        max_len_a=0, max_len_b=args.max_len_b))
    runner = generator.model.runner

    def every_beam(cache):  # the rule before: one row per sentence only where the static engine's step serves
        return cache.length == 0 and cache.beams > 1 and runner.runs_static_step(cache.real_rows // cache.beams)

    seconds, tokens = timed_rounds(decodes_after({
        "one row per sentence": lambda: own_attribute(runner, "starts_beams_once", None),  # the runner's own rule
        "every beam's row": lambda: own_attribute(runner, "starts_beams_once", every_beam),
    }, generator, model, batches), args.rounds)
    print_way_against(seconds, tokens, "one row per sentence", "every beam's row", "first step at one row per sentence")


if __name__ == "__main__":
    main()
