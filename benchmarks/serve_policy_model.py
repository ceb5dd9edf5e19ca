"""A model of fastgen-serve's decoding thread: fixed batches against continuous batching, under Poisson arrivals,
for a step-cost curve and a refill cost given on the command line (not part of the product).

    python benchmarks/serve_policy_model.py --lengths bench_out/multi30k-base/raw/test.fr \
        --sentencepiece-model bench_out/multi30k-base/raw/spm.model [--step-ms 2.0 --step-ms-per-row 0.42 ...]

The decoding thread does one thing at a time: a step of the rows it holds (``--step-ms`` + ``--step-ms-per-row``
x rows), or the start of new sentences (their encoder pass, encoder-decoder keys and first position:
``--start-ms`` + ``--start-ms-each`` x sentences; a start inside a running stream adds ``--join-ms``). A sentence
leaves after as many steps as its output has tokens (drawn from ``--lengths``: the target side of a test set,
in the model's sentencepiece pieces, plus eos; ``--length-scale`` and ``--length-spread`` stretch them to model
longer outputs). Two policies, as ``fastgen-serve`` runs them:

* fixed: a batch takes what waits (at most ``--capacity`` sentences; its first waits ``--fixed-wait-ms`` for
  more), its rows leave as they finish, and the next batch starts when its last sentence is done;
* continuous: one stream of ``--capacity`` rows; before a step, the sentences that wait enter free rows (at
  once, or, with ``--refill-share``, once that share of the rows is free).

For each offered load (a share of fixed batches' saturation, measured by the model with every sentence waiting),
it prints the median and 99th percentile latency (from arrival to the last token) of both policies, over
``--sentences`` arrivals and three seeds (the median of each). The defaults are the trained base's costs measured
by ``benchmarks/serve_iterations.py`` (int8, compiled engine, one thread, Intel Xeon): docs/serving.md says how
far the model follows the server, and what it says about the issue's targets.
"""

import argparse
import random
import statistics
from typing import List, Sequence, Tuple


class Costs:
    """Milliseconds of the decoding thread's two kinds of work."""

    def __init__(self, args):
        self.step_ms, self.per_row = args.step_ms, args.step_ms_per_row
        self.start_ms, self.start_each, self.join_ms = args.start_ms, args.start_ms_each, args.join_ms

    def step(self, rows: int) -> float:
        return self.step_ms + self.per_row * rows

    def start(self, sentences: int, joining: bool) -> float:
        return self.start_ms + self.start_each * sentences + (self.join_ms if joining else 0.0)


Arrival = Tuple[float, int]  # (ms since the first, output tokens)


def fixed_batches(arrivals: Sequence[Arrival], costs: Costs, capacity: int, wait_ms: float) -> List[Tuple[float, float]]:
    """(arrival, done) of every sentence, in the order they finish."""
    clock, next_one, done = 0.0, 0, []
    while next_one < len(arrivals):
        clock = max(clock, arrivals[next_one][0])
        closes = max(clock, arrivals[next_one][0] + wait_ms)  # the first sentence waits for others until then
        last = next_one
        while last < len(arrivals) and last - next_one < capacity and arrivals[last][0] <= closes:
            last += 1
        if last - next_one < capacity:
            clock = closes  # it waited the whole time for more
        else:
            clock = max(clock, arrivals[last - 1][0])  # full before then
        batch, next_one = arrivals[next_one:last], last
        clock += costs.start(len(batch), joining=False)
        for step in range(1, max(length for _, length in batch) + 1):
            clock += costs.step(sum(1 for _, length in batch if length >= step))
            done += [(arrived, clock) for arrived, length in batch if length == step]
    return done


def continuous_batching(arrivals: Sequence[Arrival], costs: Costs, capacity: int,
                        refill_share: float) -> List[Tuple[float, float]]:
    clock, next_one, done = 0.0, 0, []
    rows: List[List[float]] = []  # [arrival, tokens left]
    waiting: List[Arrival] = []
    while next_one < len(arrivals) or waiting or rows:
        while next_one < len(arrivals) and arrivals[next_one][0] <= clock:
            waiting.append(arrivals[next_one])
            next_one += 1
        if not rows and not waiting:
            clock = arrivals[next_one][0]
            continue
        free = capacity - len(rows)
        if waiting and free and (not rows or free >= max(1.0, refill_share * capacity)):
            entering, waiting = waiting[:free], waiting[free:]
            clock += costs.start(len(entering), joining=bool(rows))
            rows += [[arrived, length] for arrived, length in entering]
        clock += costs.step(len(rows))
        for row in rows:
            row[1] -= 1
        done += [(row[0], clock) for row in rows if row[1] == 0]
        rows = [row for row in rows if row[1] > 0]
    return done


def poisson(rate: float, count: int, lengths: Sequence[int], seed: int) -> List[Arrival]:
    rng, clock, arrivals = random.Random(seed), 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate) * 1000.0
        arrivals.append((clock, rng.choice(lengths)))
    return arrivals


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def latencies(policy, rate: float, count: int, lengths, seed: int) -> List[float]:
    """Latencies in arrival order, the first tenth (the queue filling from empty) left out."""
    finished = sorted(policy(poisson(rate, count, lengths, seed)))
    return [done - arrived for arrived, done in finished][count // 10:]


def saturation(policy, lengths) -> float:
    """Sentences/s with 3,000 sentences waiting from the start."""
    finished = policy([(0.0, length) for length in random.Random(7).choices(lengths, k=3000)])
    return len(finished) / max(done for _, done in finished) * 1000.0


def output_lengths(args) -> List[int]:
    """Output tokens (pieces + eos) of each line of --lengths, stretched by --length-scale and --length-spread."""
    lines = [line.strip() for line in open(args.lengths, encoding="utf-8") if line.strip()]
    if args.sentencepiece_model:
        import sentencepiece

        pieces = sentencepiece.SentencePieceProcessor(model_file=args.sentencepiece_model)
        lengths = [len(pieces.encode(line)) + 1 for line in lines]
    else:
        lengths = [len(line.split()) + 1 for line in lines]
    rng = random.Random(0)
    return [max(1, round(length * args.length_scale * (rng.lognormvariate(0.0, args.length_spread)
                                                          if args.length_spread else 1.0))) for length in lengths]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", required=True, help="target sentences whose lengths the outputs take")
    parser.add_argument("--sentencepiece-model", help="count --lengths in its pieces (else in words)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiply every output length")
    parser.add_argument("--length-spread", type=float, default=0.0,
                        help="and by a log-normal factor of this sigma (longer tails)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="a step's cost at no rows")
    parser.add_argument("--step-ms-per-row", type=float, default=0.42, help="and for each row")
    parser.add_argument("--start-ms", type=float, default=3.5, help="a start's cost (encoder, keys, first position)")
    parser.add_argument("--start-ms-each", type=float, default=3.8, help="and for each sentence it starts")
    parser.add_argument("--join-ms", type=float, default=1.0, help="what a start inside a running stream adds")
    parser.add_argument("--capacity", type=int, default=32, help="rows of a batch or of the stream")
    parser.add_argument("--fixed-wait-ms", type=float, default=10.0)
    parser.add_argument("--refill-share", type=float, default=0.0,
                        help="continuous: refill once this share of the rows is free (0: any free row)")
    parser.add_argument("--loads", default="0.5,0.7,0.9", help="offered loads, shares of fixed batches' saturation")
    parser.add_argument("--sentences", type=int, default=4000, help="arrivals a load and seed")
    args = parser.parse_args()

    costs, lengths = Costs(args), output_lengths(args)

    def fixed(arrivals):
        return fixed_batches(arrivals, costs, args.capacity, args.fixed_wait_ms)

    def continuous(arrivals):
        return continuous_batching(arrivals, costs, args.capacity, args.refill_share)

    fixed_saturation = saturation(fixed, lengths)
    print(f"outputs: {statistics.mean(lengths):.1f} tokens on average, at most {max(lengths)}; saturation: fixed "
          f"batches {fixed_saturation:.1f} sentences/s, continuous batching {saturation(continuous, lengths):.1f}")
    print("| load | sentences/s | fixed p50 / p99 ms | continuous p50 / p99 ms | continuous p99 / fixed p99 |")
    print("|---|---|---|---|---|")
    for load in (float(share) for share in args.loads.split(",")):
        rate, figures = load * fixed_saturation, {}
        for name, policy in (("fixed", fixed), ("continuous", continuous)):
            runs = [latencies(policy, rate, args.sentences, lengths, seed) for seed in (1, 2, 3)]
            figures[name] = [statistics.median(percentile(run, share) for run in runs) for share in (0.5, 0.99)]
        print(f"| {load:.0%} | {rate:.1f} | {figures['fixed'][0]:.0f} / {figures['fixed'][1]:.0f} | "
              f"{figures['continuous'][0]:.0f} / {figures['continuous'][1]:.0f} | "
              f"{figures['continuous'][1] / figures['fixed'][1]:.2f}x |")


if __name__ == "__main__":
    main()
