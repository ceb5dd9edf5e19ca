"""The encoder alone on the CPU paths of the compiled engine, in one process (not part of the product).

    python benchmarks/encoder_paths.py DATA_BIN CHECKPOINT [--batch-sizes 1,8,64] [--sentences 128] [--rounds 3]

Encodes the first ``--sentences`` sentences of the test split (fairseq's batches of each size, sorted by length) in
turn through: the encoder's unit compiled ahead of time (``--compiled-many-rows unit``: one unit for a row, one for
more rows, frozen), the encoder's pass eager through the plugin's float32 kernel (``--compiled-many-rows kernel``,
what ``auto`` runs on a processor with AVX2 and no AVX-512) and fairseq's own encoder (torch's products), each
``--rounds`` timed rounds after a warm-up round that builds what is missing.  Prints each way's median seconds
per batch size, the kernel's speed against the unit's, and the largest difference of the states at real positions
from fairseq's encoder.  Set ``FASTGEN_COMPILED_DIR`` to keep the units between runs.
"""

import argparse

# first: it loads the plugin
from interleaved import first_test_batches, load_test_split, print_medians, timed_rounds  # (benchmarks/)
from fairseq_fastgen.engine.compiled import CompiledRunner  # noqa: E402
from fairseq_fastgen.ops.f32_rows_linear import many_rows_kernel_available  # noqa: E402


def largest_difference(states, reference) -> float:
    """The largest absolute difference of the encoder states (src_len, rows, dim) at real positions."""
    real = ~reference["encoder_padding_mask"][0].t()  # (src_len, rows)
    return float((states["encoder_out"][0] - reference["encoder_out"][0])[real].abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--batch-sizes", default="1,8,64", help="sentences per batch, comma-separated")
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not many_rows_kernel_available():
        parser.error("the plugin's float32 kernel for AVX2 does not run here (it has no build of its own with AVX-512)")
    model, task = load_test_split(args.data_bin, args.checkpoint)
    unit = CompiledRunner(model, freezing=True, many_rows="unit")
    kernel = CompiledRunner(model, freezing=True, many_rows="kernel")
    for batch_size in (int(size) for size in args.batch_sizes.split(",")):
        batches = first_test_batches(task, batch_size, args.sentences)
        inputs = [batch["net_input"] for batch in batches]
        ways = {
            "compiled unit": lambda: [unit.encode(net_input) for net_input in inputs],
            "kernel": lambda: [kernel.encode(net_input) for net_input in inputs],
            "fairseq's encoder": lambda: [model.encoder(net_input["src_tokens"], net_input["src_lengths"])
                                          for net_input in inputs],
        }
        seconds, outputs = timed_rounds(ways, args.rounds)
        print(f"batch size {batch_size} ({len(inputs)} batches):")
        median = print_medians(seconds, sum(len(batch["id"]) for batch in batches))
        reference = outputs["fairseq's encoder"]
        differences = {way: max(map(largest_difference, outputs[way], reference))
                       for way in ("compiled unit", "kernel")}
        print(f"the kernel's pass: {median['compiled unit'] / median['kernel']:.2f}x the unit; largest difference of "
              f"the states from fairseq's: unit {differences['compiled unit']:.1e}, kernel {differences['kernel']:.1e}")


if __name__ == "__main__":
    main()
