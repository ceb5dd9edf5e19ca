"""Greedy decoding on --step-engine compiled with and without the encoder's compiled unit, in one process (not part
of the product).

    python benchmarks/encoder_unit_ab.py DATA_BIN CHECKPOINT [--batch-size 1] [--sentences 300] [--rounds 3]
        [--quantize int8] [--decoder blockwise --blockwise-int8-proposals] [--max-len-b 25]

Decodes the first ``--sentences`` sentences of the test split in batches of ``--batch-size`` with one generator
(``--step-engine compiled --compiled-freezing``, one thread), its runner's encoder unit
(``CompiledRunner.units.encoder_pass``) switched on and off in turn for ``--rounds`` timed rounds after a warm-up round,
so a change in the machine's speed hits both alike. Prints the seconds of each round, the medians, their ratio,
and how many sentences got the same tokens both ways. Set ``FASTGEN_COMPILED_DIR`` to keep the units between
runs (the warm-up round compiles what is missing).
"""

# first: it loads the plugin, whose options fairseq's GenerationConfig then has
from interleaved import (ab_parser, decodes_after, first_test_batches, load_test_split,  # (benchmarks/, the
                         print_way_against, timed_rounds)  # A/B scripts' own)
from fairseq.dataclass.configs import GenerationConfig  # noqa: E402


def main():
    parser = ab_parser(__doc__, batch_size=1, sentences=300)
    parser.add_argument("--quantize", help="the units' precision (int8: the encoder's unit holds int8 rows)")
    parser.add_argument("--decoder", default="greedy")
    parser.add_argument("--blockwise-int8-proposals", action="store_true")
    args = parser.parse_args()
    model, task = load_test_split(args.data_bin, args.checkpoint)
    batches = first_test_batches(task, args.batch_size, args.sentences)
    generator = task.build_generator([model], GenerationConfig(
        beam=1, decoder=args.decoder, step_engine="compiled", compiled_freezing=True, quantize=args.quantize,
        blockwise_int8_proposals=args.blockwise_int8_proposals, max_len_a=0, max_len_b=args.max_len_b))
    units = generator.runner.units
    encoder_pass = units.encoder_pass
    if encoder_pass is None:
        raise SystemExit("this runner has no encoder unit (not on the CPU with oneDNN, or an encoder it cannot serve)")

    seconds, tokens = timed_rounds(decodes_after({
        "encoder unit": lambda: setattr(units, "encoder_pass", encoder_pass),
        "fairseq's encoder": lambda: setattr(units, "encoder_pass", None),
    }, generator, model, batches), args.rounds)
    print_way_against(seconds, tokens, "encoder unit", "fairseq's encoder", "with the encoder unit")


if __name__ == "__main__":
    main()
