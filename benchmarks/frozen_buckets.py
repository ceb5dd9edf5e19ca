"""fastgen-bench with the compiled engine's frozen row buckets up to N rows for the runners of one row a sentence
(``FROZEN_MAX_ROWS``; runners of fairseq's beam search and of k-head models keep at most 4): the A/B of
docs/benchmarks.md, "greedy-stream", "At base size".

    python benchmarks/frozen_buckets.py N FASTGEN_BENCH_ARGUMENTS...
"""

import sys

from fairseq_fastgen.engine import compiled


def main():
    if len(sys.argv) < 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        sys.exit("usage: python benchmarks/frozen_buckets.py N FASTGEN_BENCH_ARGUMENTS... (N: a row count, 1 or more)")
    compiled.FROZEN_MAX_ROWS = int(sys.argv[1])
    from fairseq_fastgen.bench import cli_main

    cli_main(sys.argv[2:])


if __name__ == "__main__":
    main()
