"""Benchmark of ``--cluster-projection`` on one model (a command, not a test).

    python -m fairseq_fastgen.bench.cluster_projection DATA --path CKPT \\
        --clusters 32,128,512 --top-k 1,3,5 [--max-states N] [--json OUT]

Records the training split's decoder states once, builds a cluster file for
every (clusters, K), and reports for each, against the full projection:
the projection step's time ratio (median of repeated warm calls on real
test-set states, 1 and beam x batch rows); with fairseq's beam search at beam 1
batch 1 and beam 5 batch 64, the fraction of test sentences whose output is
identical, the BLEU difference, and the sentences/s ratio (median over
interleaved full / projected runs on a subset, so that load changes on a
shared machine hit both alike).

With ``--files-only --save-dir DIR`` it only builds the grid's cluster files,
``DIR/c{clusters}k{K}.pt``, from the one recording, for fastgen-bench to measure
(``--variant c1000k3=--cluster-projection DIR/c1000k3.pt``, ...).
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fairseq_fastgen.adapters.output_layer import attached
from fairseq_fastgen.cluster import train
from fairseq_fastgen.cluster.clusterfile import ClusterFile, ModelFingerprint
from fairseq_fastgen.cluster.projection import ProjectionStatistics, load_projection
from fairseq_fastgen.cluster.train import cluster_active_sets, special_tokens, states_and_top_tokens

DECODE_SETTINGS = ((1, 1), (5, 64))  # (beam, batch size)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m fairseq_fastgen.bench.cluster_projection", description=__doc__)
    parser.add_argument("data", help="fairseq data-bin directory")
    parser.add_argument("--path", required=True, help="model checkpoint")
    parser.add_argument("--train-split", default="train", help="split whose states are clustered")
    parser.add_argument("--test-split", default="test", help="split that is translated")
    parser.add_argument("--clusters", default="32,128,512", help="comma-separated cluster counts")
    parser.add_argument("--top-k", default="1,3,5", help="comma-separated K values")
    parser.add_argument("--max-states", type=int, default=200000, help="states recorded for clustering")
    parser.add_argument("--timing-sentences", type=int, default=64,
                        help="time sentences/s on the batches holding the first this many test sentences")
    parser.add_argument("--timing-pairs", type=int, default=3,
                        help="interleaved (full, projected) timed runs; the median ratio is reported")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per projection measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--save-dir", help="keep the cluster files here (default: a temporary folder)")
    parser.add_argument("--files-only", action="store_true",
                        help="build the cluster files into --save-dir and measure nothing")
    args = parser.parse_args(argv)
    if args.files_only and not args.save_dir:
        parser.error("--files-only needs --save-dir")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = train.ClusterTrainingConfig(data=args.data, path=args.path, output="", split=args.train_split,
                                      top_k=max(int(k) for k in args.top_k.split(",")),
                                      max_states=args.max_states, cpu=True)
    model, task = train.load_model(cfg)
    task.load_dataset(args.test_split)
    with torch.no_grad():
        states, top_tokens = train.record_states(model, task, cfg)
    if args.files_only:
        Path(args.save_dir).mkdir(parents=True, exist_ok=True)
        for clusters, k, centroids in grid(states, cfg, args):
            path = build_file(model, task, states, top_tokens[:, :k], centroids, k, Path(args.save_dir))[0]
            print(path, flush=True)
        return
    with torch.no_grad():
        test_features = held_out_states(model, task, args.test_split)
        baseline = {setting: translate(model, task, args, *setting) for setting in DECODE_SETTINGS}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clusters, k, centroids in grid(states, cfg, args):
            rows.append(measure(model, task, args, states, top_tokens[:, :k], centroids, k, test_features,
                                baseline, Path(args.save_dir or tmp)))
            print(json.dumps(rows[-1]), flush=True)
    report = {"baseline": {f"beam{b}_batch{n}": {k: v for k, v in r.items() if k != "outputs"}
                           for (b, n), r in baseline.items()}, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print_table(report)


def grid(states, cfg, args):
    """(clusters, K, centroids) for every cluster count and K of the grid; k-means once per count."""
    for clusters in (int(c) for c in args.clusters.split(",")):
        cfg.num_clusters = clusters
        centroids = train.kmeans_centroids(states, cfg)
        for k in (int(k) for k in args.top_k.split(",")):
            yield clusters, k, centroids


def build_file(model, task, states, top_tokens, centroids, k, directory: Path):
    """Write ``directory/c{clusters}k{K}.pt``; returns (its path, the active sets)."""
    active_sets = cluster_active_sets(states, top_tokens, centroids, special_tokens(task.target_dictionary),
                                      len(task.target_dictionary))
    path = directory / f"c{centroids.size(0)}k{k}.pt"
    ClusterFile.build(centroids, active_sets, ModelFingerprint.of_decoder(model.decoder), top_k=k,
                      states=int(states.shape[0]), source_lang=task.cfg.source_lang,
                      target_lang=task.cfg.target_lang).save(path)
    return path, active_sets


def measure(model, task, args, states, top_tokens, centroids, k, test_features, baseline, directory):
    path, active_sets = build_file(model, task, states, top_tokens, centroids, k, directory)
    projection = load_projection(path, model)
    row = {"clusters": centroids.size(0), "top_k": k,
           "mean_set_size": float(active_sets.offsets.diff().float().mean())}
    with torch.no_grad():
        for rows in (1, DECODE_SETTINGS[-1][0] * DECODE_SETTINGS[-1][1]):  # one state; beam x batch states
            full, projected = projection_times(model.decoder, projection, test_features, rows, args.repeats)
            row[f"projection_speedup_rows{rows}"] = full / projected
        for (beam, batch), plain in baseline.items():
            projection.statistics = ProjectionStatistics()
            result = translate(model, task, args, beam, batch, projection=projection)
            name = f"beam{beam}_batch{batch}"
            same = sum(plain["outputs"][i] == out for i, out in result["outputs"].items())
            row[f"{name}_identical"] = same / len(plain["outputs"])
            row[f"{name}_bleu_delta"] = result["bleu"] - plain["bleu"]
            row[f"{name}_active_fraction_mean"] = projection.statistics.as_dict()["projection_active_fraction_mean"]
            row[f"{name}_speed_ratio"] = speed_ratio(model, task, args, projection, beam, batch)
    return row


def speed_ratio(model, task, args, projection, beam, batch):
    """Median over interleaved (full, projected) pairs of timed runs on the first
    ``--timing-sentences``: the ratio of sentences/s, projected over full."""
    ratios = []
    for _ in range(args.timing_pairs):
        full = translate(model, task, args, beam, batch, args.timing_sentences)["seconds"]
        projected = translate(model, task, args, beam, batch, args.timing_sentences, projection)["seconds"]
        ratios.append(full / projected)
    return statistics.median(ratios)


def held_out_states(model, task, split):
    """Teacher-forced decoder states of the test split, (states, 1, hidden)."""
    parts = []
    for sample in batches(task, split, 64):
        net_input = sample["net_input"]
        states, _ = states_and_top_tokens(model, sample, net_input["prev_output_tokens"], sample["target"], 1,
                                          task.target_dictionary.pad())
        parts.append(states)
    return torch.cat(parts).unsqueeze(1)


def projection_times(decoder, projection, features, rows, repeats):
    """Median seconds of the full and the cluster projection over ``repeats`` batches of ``rows`` states."""
    generator = torch.Generator().manual_seed(rows)
    full, projected = [], []
    for _ in range(repeats + 1):  # the first call of each warms up
        batch = features[torch.randint(0, features.size(0), (rows,), generator=generator)]
        start = time.perf_counter()
        decoder.output_layer(batch)
        middle = time.perf_counter()
        projection(batch, decoder)
        end = time.perf_counter()
        full.append(middle - start)
        projected.append(end - middle)
    return statistics.median(full[1:]), statistics.median(projected[1:])


def batches(task, split, batch_size):
    return task.get_batch_iterator(
        dataset=task.dataset(split), max_sentences=batch_size, required_batch_size_multiple=1,
        disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=False)


def translate(model, task, args, beam, batch_size, sentences=0, projection=None):
    """fairseq's beam search over the batches holding the first ``sentences`` of the
    test split (0: all), with ``projection`` attached when given: outputs by sentence id, BLEU, seconds."""
    import sacrebleu
    from omegaconf import OmegaConf
    from fairseq import utils
    from fairseq.dataclass.configs import GenerationConfig

    generator = task.build_generator([model], OmegaConf.structured(GenerationConfig(beam=beam)))
    dictionary = task.target_dictionary
    outputs, references = {}, {}
    with attached(model.decoder, projection) if projection is not None else contextlib.nullcontext():
        start = time.perf_counter()
        for sample in batches(task, args.test_split, batch_size):
            if sentences and len(outputs) >= sentences:
                break
            hypotheses = task.inference_step(generator, [model], sample)
            for sentence_id, hyps, target in zip(sample["id"].tolist(), hypotheses, sample["target"]):
                outputs[sentence_id] = dictionary.string(hyps[0]["tokens"])
                references[sentence_id] = dictionary.string(utils.strip_pad(target, dictionary.pad()))
        seconds = time.perf_counter() - start
    ids = sorted(outputs)
    bleu = sacrebleu.corpus_bleu([outputs[i] for i in ids], [[references[i] for i in ids]]).score
    return {"outputs": outputs, "bleu": bleu, "seconds": seconds, "sentences_per_second": len(ids) / seconds}


def print_table(report):
    largest = DECODE_SETTINGS[-1][0] * DECODE_SETTINGS[-1][1]
    columns = ["clusters", "top_k", "mean_set_size", "projection_speedup_rows1", f"projection_speedup_rows{largest}"]
    for beam, batch in DECODE_SETTINGS:
        name = f"beam{beam}_batch{batch}"
        columns += [f"{name}_speed_ratio", f"{name}_identical", f"{name}_bleu_delta", f"{name}_active_fraction_mean"]
    print(json.dumps(report["baseline"]))
    print("\t".join(columns))
    for row in report["rows"]:
        print("\t".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns))


if __name__ == "__main__":
    sys.exit(main())
