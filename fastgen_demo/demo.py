"""``make demo``: the main job on the embedded default, each method where it is meant to pay.

1. generate the synthetic English-like -> French-like corpus (fastgen_demo.synthetic),
2. binarize it with fairseq-preprocess,
3. train a tiny base transformer with fairseq-train (its progress lines show),
4. train a k-head student on top of it (frozen base, the blockwise method's cheapest variant),
5. train a cluster file on the base model's decoder states (fastgen-train-clusters),
6. two ``fastgen-bench`` runs on the test split (CTranslate2 beside them when it is installed):
   - latency: greedy and blockwise at batch 1 and at batch 64;
   - throughput: stock beam search, var-batch and var-stream at beam 5, batch 64, each also with the
     cluster-projected vocabulary (rows marked /cp);
7. one table of both runs, one line per method saying what it showed, and the paths of the results.

Everything lands in ``demo_out/`` (or ``--out``); finished steps are reused on a rerun.
"""

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_fastgen import bench
from fastgen_demo import toy

BASE_SPEC = toy.ToyModelSpec(layers=2, dim=128, ffn=256, heads=4, max_positions=128, max_update=600,
                             max_tokens=4096, lr=0.003, warmup=200, validate_interval=4)
KHEAD_BLOCK_SIZE = 4
CLUSTERS, CLUSTER_TOP_K, CLUSTER_STATES = 64, 3, 100000
BEAM = 5
LATENCY_DECODERS = ("greedy", "blockwise")  # beam 1, batch 1 and 64
THROUGHPUT_DECODERS = ("beam", "var-batch", "var-stream")  # beam 5, batch 64, with and without /cp
CTRANSLATE2 = "ctranslate2"  # fastgen-bench's label of the peer
THREADS = 1  # as docs/benchmarks.md measures; on a busy 2-core machine two threads wait on each other


@dataclass
class DemoModels:
    data_bin: Path
    base: Path  # checkpoint of the base transformer
    khead: Path  # checkpoint of the k-head student (same dictionaries)
    clusters: Path  # cluster file of the base model


def khead_spec(base_checkpoint):
    return toy.ToyModelSpec(
        **{**BASE_SPEC.__dict__, "arch": "transformer_khead", "max_update": 200, "lr": 0.002, "warmup": 50,
           "extra_args": ["--block-size", str(KHEAD_BLOCK_SIZE), "--khead-identity-first", "--freeze-base",
                          "--base-checkpoint", str(base_checkpoint)]}
    )


def step(title, done_marker, action):
    started = time.time()
    if Path(done_marker).exists():
        print(f"== {title}: reusing {done_marker}", flush=True)
        return
    print(f"== {title}", flush=True)
    action()
    print(f"   done in {time.time() - started:.0f}s", flush=True)


def plugin_command(module: str, script: str) -> List[str]:
    """The plugin's console script of the running interpreter's environment, else its module."""
    installed = Path(sys.executable).parent / script
    return [str(installed)] if installed.exists() else [sys.executable, "-m", module]


def train_clusters(data_bin, checkpoint, output, clusters=CLUSTERS, states=CLUSTER_STATES):
    toy.run(plugin_command("fairseq_fastgen.cluster.train", "fastgen-train-clusters") + [
        str(data_bin), "--path", str(checkpoint), "--split", "train", "--num-clusters", str(clusters),
        "--top-k", str(CLUSTER_TOP_K), "--max-states", str(states), "--output", str(output), "--cpu",
    ], log_path=Path(output).with_suffix(".log"))


def build_models(out: Path, train_sentences: int) -> DemoModels:
    step("corpus", out / "raw" / "test.fr",
         lambda: print("  ", toy.make_corpus(out / "raw", n_train=train_sentences)["counts"]))
    step("binarize", out / "bin" / "test.en-fr.fr.bin", lambda: toy.binarize(out / "raw", out / "bin"))
    base = out / "base" / "checkpoint_last.pt"
    step("train base transformer", base, lambda: toy.train(out / "bin", out / "base", BASE_SPEC, show_progress=True))
    khead = out / "khead" / "checkpoint_last.pt"
    step(f"train k-head student (k={KHEAD_BLOCK_SIZE}, frozen base)", khead,
         lambda: toy.train(out / "bin", out / "khead", khead_spec(base), show_progress=True,
                           criterion_args=["--criterion", "random_subloss", "--label-smoothing", "0.1"]))
    clusters = out / "clusters" / "base.clusters.pt"
    clusters.parent.mkdir(parents=True, exist_ok=True)
    step(f"train a cluster file ({CLUSTERS} clusters of decoder states)", clusters,
         lambda: train_clusters(out / "bin", base, clusters))
    return DemoModels(out / "bin", base, khead, clusters)


# ---- the table step ------------------------------------------------------------------------------
def bench_runs(models: DemoModels) -> Dict[str, List[str]]:
    """Name -> fastgen-bench arguments of each run (beside DATA, --output-dir and the common ones)."""
    return {
        "latency": ["--path", str(models.base), "--khead-path", str(models.khead),
                    "--decoders", ",".join(LATENCY_DECODERS), "--beam", "1", "--batch-size", "1,64",
                    "--reference", "greedy"],
        "throughput": ["--path", str(models.base), "--cluster-projection", str(models.clusters),
                       "--decoders", ",".join(THROUGHPUT_DECODERS), "--beam", str(BEAM), "--batch-size", "64"],
    }


def run_benches(models: DemoModels, out: Path, repeat: int) -> Dict[str, Path]:
    """Run each fastgen-bench in this process (its progress bar on stderr, its own table kept in its
    output directory); returns name -> output directory."""
    directories = {}
    for name, arguments in bench_runs(models).items():
        directory = out / "bench" / name
        directory.mkdir(parents=True, exist_ok=True)
        argv = [str(models.data_bin), *arguments, "--repeat", str(repeat), "--threads", str(THREADS),
                "--output-dir", str(directory)]
        print(f"== fastgen-bench {' '.join(argv)}", flush=True)
        with open(directory / "stdout.log", "w") as table_log, contextlib.redirect_stdout(table_log):
            bench.main(argv)
        directories[name] = directory
    return directories


def load_records(directories: Dict[str, Path]) -> Dict[str, dict]:
    """Label -> results.json record of every measured configuration of every run."""
    records = {}
    for directory in directories.values():
        for record in json.loads((directory / "results.json").read_text())["configurations"]:
            if record["status"] == "ok":
                records[record["label"]] = record
    return records


def speed(record: dict) -> float:
    return record["sentences_per_second"]["median"]


def statistic_cell(record: dict) -> str:
    statistics = record.get("statistics") or {}
    shown = {"mean_accepted_block_size": "mean block", "candidate_expansions_per_step": "expansions/step",
             "projection_active_fraction_mean": "active vocabulary"}
    cells = []
    for key, name in shown.items():
        if key in statistics:
            value = statistics[key]
            cells.append(f"{name} {100 * value:.1f}%" if "fraction" in key else f"{name} {value:.2f}")
    return ", ".join(cells)


def table(records: Dict[str, dict]) -> str:
    rows = ["| configuration | sentences/s | BLEU | identical to | statistics |", "|---|---|---|---|---|"]
    for label, record in records.items():
        identical = "" if record.get("identical_rate") is None else \
            f"{100 * record['identical_rate']:.1f}% {record['reference']}"
        bleu = "" if record.get("bleu") is None else f"{record['bleu']:.2f}"
        rows.append(f"| {label} | {speed(record):.1f} | {bleu} | {identical} | {statistic_cell(record)} |")
    return "\n".join(rows)


def ratio(records, label, against) -> Optional[float]:
    if label in records and against in records:
        return speed(records[label]) / speed(records[against])
    return None


def identical(records, label) -> str:
    record = records.get(label)
    if record is None or record.get("identical_rate") is None:
        return "?"
    return f"{100 * record['identical_rate']:.1f}%"


def blockwise_line(records) -> str:
    one, many = ratio(records, "blockwise/b1/bs1", "greedy/b1/bs1"), ratio(records, "blockwise/b1/bs64", "greedy/b1/bs64")
    if one is None:
        return "blockwise: no row (see the bench log)"
    block = records["blockwise/b1/bs1"]["statistics"].get("mean_accepted_block_size", 0.0)
    verdict = "faster than greedy" if one > 1 else (
        "not faster here: on a model this small a step is mostly fixed overhead, and a blockwise iteration has more "
        "of it than a greedy step; at base size (transformer_wmt_en_de, 32k vocabulary) the frozen-base k=4 student "
        "trained on this CPU runs 1.17x greedy and its fine-tuned narrow student 1.5x on --step-engine compiled "
        "--compiled-freezing: docs/benchmarks.md, Blockwise parallel decoding: At batch 1 (base size)")
    return (f"blockwise (k={KHEAD_BLOCK_SIZE} student, frozen base): {one:.2f}x greedy's sentences/s at batch 1, "
            f"{many:.2f}x at batch 64 ({verdict}); {block:.2f} tokens accepted per call; "
            f"{identical(records, 'blockwise/b1/bs1')} of its outputs are greedy's")


def streaming_line(records) -> str:
    stock = f"beam/b{BEAM}/bs64"
    parts, ratios = [], []
    for decoder in ("var-batch", "var-stream"):
        label = f"{decoder}/b{BEAM}/bs64"
        if label in records and stock in records:
            bleu = records[label]["bleu"] - records[stock]["bleu"] if records[label].get("bleu") is not None else 0.0
            ratios.append(ratio(records, label, stock))
            parts.append(f"{decoder} {ratios[-1]:.2f}x stock beam {BEAM}'s sentences/s (BLEU {bleu:+.2f})")
    if not parts:
        return "variable-width beam search: no row (see the bench log)"
    caveat = "" if min(ratios) > 1 else " (pruning and refills pay more at wider beams: beam 20 is in docs/benchmarks.md)"
    return "variable-width beam search: " + "; ".join(parts) + caveat


def cluster_line(records) -> str:
    label, stock = f"beam/b{BEAM}/bs64/cp", f"beam/b{BEAM}/bs64"
    if label not in records or stock not in records:
        return "cluster projection: no /cp row (see the bench log)"
    statistics = records[label]["statistics"]
    speedup = statistics.get("projection_speedup")
    projection = f"its projection step {speedup:.2f}x as fast as the full one, " if speedup else ""
    whole = ratio(records, label, stock)
    small_gain = (speedup or 0.0) < 1.5 or whole <= 1  # the method's point: a much cheaper projection
    caveat = "" if not small_gain else (" (a vocabulary this small leaves the projection little to save; it is meant "
                                        "for 32k-token vocabularies: the base-size model's figures are in "
                                        "docs/benchmarks.md, Cluster-projected vocabulary: Base size (32k tokens))")
    return (f"cluster-projected vocabulary: stock beam {BEAM} with it: {projection}{whole:.2f}x the sentences/s, "
            f"{identical(records, label)} of outputs identical{caveat}")


def peer_line(records) -> str:
    peers = [label for label in records if label.startswith(CTRANSLATE2)]
    if not peers:
        return ("CTranslate2: not installed, so no peer row; `.venv/bin/pip install ctranslate2` adds it "
                "(fastgen-bench measures it beside the plugin in the same run)")
    pairs = [("greedy/b1/bs1", f"{CTRANSLATE2}/b1/bs1"), ("greedy/b1/bs64", f"{CTRANSLATE2}/b1/bs64"),
             (f"beam/b{BEAM}/bs64", f"{CTRANSLATE2}/b{BEAM}/bs64")]
    shown = [f"{label} {ratio(records, label, peer):.2f}x" for label, peer in pairs if ratio(records, label, peer)]
    return "against CTranslate2 (the plugin's sentences/s over CTranslate2's): " + ", ".join(shown)


def summary(records: Dict[str, dict], directories: Dict[str, Path]) -> str:
    lines = [table(records), "", "What each method showed:"]
    lines += [f"- {line(records)}" for line in (blockwise_line, streaming_line, cluster_line, peer_line)]
    lines += ["", "Results (results.json, results.md, hypotheses/) and plots:"]
    for directory in directories.values():
        lines.append(f"- {directory}/results.json, {directory}/bleu_vs_speed.png")
    return "\n".join(lines)


def table_step(models: DemoModels, out: Path, repeat: int = 1) -> str:
    """Run the benches and return the demo's closing text (also written to ``out/demo.md``)."""
    directories = run_benches(models, out, repeat)
    text = summary(load_records(directories), directories)
    (out / "demo.md").write_text(text + "\n")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="working directory (default: demo_out)")
    parser.add_argument("--train-sentences", type=int, default=20000, help="synthetic training sentences")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per configuration (fastgen-bench)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    models = build_models(out, args.train_sentences)
    text = table_step(models, out, args.repeat)
    print(f"\n{text}\n\ndemo finished in {time.time() - started:.0f}s; this text is in {out / 'demo.md'}", flush=True)


if __name__ == "__main__":
    main()
