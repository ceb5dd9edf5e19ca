"""Cluster projection on a multilingual model: the paper's Figure 2 and the speed of a chosen setting (a benchmark).

Usage (from the repository root; ``benchmarks/multilingual_clusters.sh`` runs it with the corpus paths):

    .venv/bin/python benchmarks/multilingual_clusters.py --en-fr ../shared/data/multi30k-en-fr \\
        --cs ../shared/data/multi30k-cs --out bench_out/multilingual

Steps, each skipped when its output exists (so a rerun resumes):

1. sentencepiece: one model (``--spm-vocab``) over the English, Czech and French training
   text (Multi30k is multi-parallel: line i of every language is the same caption); every
   split encoded (train, valid = val, test = test_2016_flickr, test1 = test_2018_flickr);
2. fairseq-preprocess: one dictionary for the three languages, en-fr and cs-fr binarized;
3. one shared ``transformer`` over both directions, as fairseq trains multilingual models
   (``--task translation_multi_simple_epoch --lang-pairs en-fr,cs-fr --encoder-langtok src
   --decoder-langtok``), with benchmarks/multi30k.py's base settings;
4. Figure 2 (``figure2.json``): each direction's decoder states, teacher-forced on the
   training split (up to ``--max-states`` per direction, K = 1), clustered for every count of
   ``--clusters`` per direction (scope ``direction``) and pooled into French (scope
   ``target``); per direction and scope, the largest and the mean active share of the
   vocabulary over the clusters that serve it, and the mean share over the direction's
   held-out (test) states, each assigned to its nearest cluster;
   the ``--chosen-clusters`` files are kept as ``clusters-direction/`` and ``clusters-target/``
   (directories of ``--cluster-projection``, written as fastgen-train-clusters writes them);
5. fastgen-bench per direction at beam 5, batch 64 (``--bench-sentences`` of the test split,
   ``--repeat`` timed passes): stock beam search without and with each scope's directory:
   projection speedup, sentences/s ratio, identical outputs and BLEU difference (``bench.md``).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import sentencepiece
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multi30k import add_base_model_options, base_spec, console_script, read_lines, step  # noqa: E402

from fastgen_demo import toy  # noqa: E402
from fastgen_demo.toy_multilingual import (  # noqa: E402
    binarize_multilingual, multilingual_spec, multilingual_task_args,
)

SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr", "test1": "test_2018_flickr"}
SOURCES, TARGET = ("en", "cs"), "fr"
PAIRS = [f"{source}-{TARGET}" for source in SOURCES]
SCOPES = ("direction", "target")


def corpus_file(args, lang, name):
    return Path(args.cs if lang == "cs" else args.en_fr) / f"{name}.{lang}.gz"


def prepare_text(args, raw):
    """sentencepiece over the three languages' training text; every split of every language encoded."""
    raw.mkdir(parents=True, exist_ok=True)
    languages = (*SOURCES, TARGET)
    text = {(split, lang): read_lines(corpus_file(args, lang, name)) for split, name in SPLITS.items()
            for lang in languages}
    for split in SPLITS:
        counts = {lang: len(text[(split, lang)]) for lang in languages}
        if len(set(counts.values())) != 1:
            sys.exit(f"split {split} is not line-aligned across languages: {counts}")
        if split == "train" and args.max_train_lines:
            for lang in languages:
                text[(split, lang)] = text[(split, lang)][: args.max_train_lines]
    joint = raw / "spm_train.txt"
    joint.write_text("\n".join(line for lang in languages for line in text[("train", lang)]) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(joint), model_prefix=str(raw / "spm"), vocab_size=args.spm_vocab, model_type="unigram",
        character_coverage=1.0, num_threads=2, bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(raw / "spm.model"))
    for (split, lang), lines in text.items():
        pieces = [" ".join(processor.encode(line, out_type=str)) for line in lines]
        (raw / f"{split}.{lang}").write_text("\n".join(pieces) + "\n", encoding="utf-8")


# ---- 4. Figure 2 -------------------------------------------------------------------------------
def figure2(args, checkpoint, bin_dir, out):
    """Record each direction's states once, cluster them per scope for every count; keep the chosen files."""
    from fairseq_fastgen.cluster import train
    from fairseq_fastgen.bench.cluster_projection import held_out_states
    from fairseq_fastgen.cluster.clusterfile import ModelFingerprint, output_projection_of
    from fairseq_fastgen.cluster.directory import write_directory
    from fairseq_fastgen.cluster.multilingual import direction_task, target_language_tokens

    torch.set_num_threads(args.threads)
    cfg = train.ClusterTrainingConfig(data=str(bin_dir), path=str(checkpoint), output="", split="train", top_k=1,
                                      max_states=args.max_states, cpu=True)
    model, task = train.load_model(cfg, load_split=False)
    fingerprint = ModelFingerprint.of_decoder(model.decoder)
    projection = output_projection_of(model.decoder)  # the outside-mass estimate of every file is fitted on it
    specials = train.special_tokens(task.target_dictionary) + target_language_tokens(task, TARGET)
    recordings, test_states = {}, {}
    with torch.no_grad():
        for pair in PAIRS:
            source_lang, target_lang = pair.split("-")
            one_direction = direction_task(task, source_lang, target_lang)
            one_direction.load_dataset("train")
            one_direction.load_dataset("test")
            states, top_tokens = train.record_states(model, one_direction, cfg)
            recordings[pair] = train.Recording(source_lang, target_lang, states, top_tokens)
            test_states[pair] = held_out_states(model, one_direction, "test").squeeze(1)  # (states, hidden)
    rows, chosen = [], {scope: [] for scope in SCOPES}
    for clusters in args.clusters:
        cfg.num_clusters = clusters
        files = {}
        for scope in SCOPES:
            cfg.cluster_scope = scope
            for (source_lang, target_lang), members in train.group_by_scope(list(recordings.values()), scope).items():
                train.check_enough_states(cfg, members, f" ({scope} {source_lang or '*'}-{target_lang})")
                cluster_file = train.cluster_file_of(cfg, members, fingerprint, specials, source_lang, target_lang,
                                                     projection)
                for member in members:
                    files[(scope, f"{member.source_lang}-{member.target_lang}")] = cluster_file
                if clusters == args.chosen_clusters:
                    chosen[scope].append(cluster_file)
        for (scope, pair), cluster_file in sorted(files.items()):
            rows.append({"direction": pair, "scope": scope, "clusters": clusters,
                         **active_shares(cluster_file, test_states[pair])})
            print(json.dumps(rows[-1]), flush=True)
    for scope, cluster_files in chosen.items():
        if cluster_files:
            write_directory(out / f"clusters-{scope}", cluster_files)
    (out / "figure2.json").write_text(json.dumps({"max_states_per_direction": args.max_states, "top_k": 1,
                                                   "vocab_size": fingerprint.vocab_size, "rows": rows}, indent=2))


def active_shares(cluster_file, test_states):
    """Shares of the vocabulary: the largest and the mean active set over the clusters, and the mean
    over the held-out states (test_states (states, hidden)) of their nearest cluster's set."""
    from fairseq_fastgen.cluster.projection import nearest_clusters

    vocab_size = cluster_file.fingerprint.vocab_size
    sizes = cluster_file.offsets.diff().double()  # (clusters,)
    nearest = nearest_clusters(test_states, cluster_file.centroids, cluster_file.centroid_sqnorms)  # (states,)
    return {"largest_share": float(sizes.max()) / vocab_size, "mean_share": float(sizes.mean()) / vocab_size,
            "mean_share_test_states": float(sizes[nearest].mean()) / vocab_size,
            "largest_share_test_states": float(sizes[nearest].max()) / vocab_size}


def figure2_table(out):
    report = json.loads((out / "figure2.json").read_text())
    lines = [f"Figure 2: active share of the {report['vocab_size']}-token vocabulary, K = 1, up to "
             f"{report['max_states_per_direction']} training states per direction",
             "", "| direction | clusters | scope | largest share | mean share | mean share, test states |",
             "|---|---|---|---|---|---|"]
    for row in sorted(report["rows"], key=lambda r: (r["direction"], r["clusters"], r["scope"])):
        lines.append(f"| {row['direction']} | {row['clusters']} | {row['scope']} | {100 * row['largest_share']:.1f}% | "
                     f"{100 * row['mean_share']:.1f}% | {100 * row['mean_share_test_states']:.1f}% |")
    return "\n".join(lines)


# ---- 5. fastgen-bench ----------------------------------------------------------------------------
def bench(args, checkpoint, bin_dir, out, pair):
    source_lang, target_lang = pair.split("-")
    command = [console_script("fastgen-bench"), str(bin_dir), "--path", str(checkpoint), "--cpu",
               "--threads", str(args.threads), "--decoders", "beam", "--beam", "5", "--batch-size", "64",
               "--repeat", str(args.repeat), "--max-sentences", str(args.bench_sentences), "--no-ctranslate2",
               "--no-progress-bar", "--reference", "self", "--post-process", "sentencepiece",
               *multilingual_task_args(PAIRS), "--source-lang", source_lang, "--target-lang", target_lang,
               "--output-dir", str(out / f"bench-{pair}")]
    for scope in SCOPES:
        command += ["--variant", f"{scope}=--cluster-projection {out / f'clusters-{scope}'}"]
    with open(out / f"bench-{pair}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)


def bench_table(out, chosen_clusters):
    lines = [f"Beam 5, batch 64, stock beam search, {chosen_clusters} clusters, K = 1, against the full projection",
             "", "| direction | scope | active vocabulary mean (max) | projection speedup | sentences/s ratio | "
             "identical | BLEU (full) | BLEU difference |", "|---|---|---|---|---|---|---|---|"]
    for pair in PAIRS:
        configurations = json.loads((out / f"bench-{pair}" / "results.json").read_text())["configurations"]
        full = next(c for c in configurations if c["variant"] is None)
        for scope in SCOPES:
            c = next(c for c in configurations if c["variant"] == scope)
            stats = c["statistics"]
            ratio = c["sentences_per_second"]["median"] / full["sentences_per_second"]["median"]
            lines.append(f"| {pair} | {scope} | {100 * stats['projection_active_fraction_mean']:.1f}% "
                         f"({100 * stats['projection_active_fraction_max']:.1f}%) | "
                         f"{stats['projection_speedup']:.2f}x | {ratio:.2f}x | {100 * c['identical_rate']:.1f}% | "
                         f"{full['bleu']:.2f} | {c['bleu'] - full['bleu']:+.2f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--en-fr", default="../shared/data/multi30k-en-fr", help="gzipped Multi30k English and French")
    parser.add_argument("--cs", default="../shared/data/multi30k-cs", help="gzipped Multi30k Czech")
    parser.add_argument("--out", default="bench_out/multilingual", help="working directory")
    parser.add_argument("--spm-vocab", type=int, default=8000)
    parser.add_argument("--max-train-lines", type=int, default=0, help="use the first N training lines (0: all)")
    add_base_model_options(parser)
    parser.set_defaults(max_update=2400)  # both directions: about as many epochs per direction as multi30k.py's 1200
    parser.add_argument("--max-states", type=int, default=200000, help="training states recorded per direction")
    parser.add_argument("--clusters", default="100,200,300,400,500", help="comma-separated cluster counts")
    parser.add_argument("--chosen-clusters", type=int, default=400, help="cluster count of the speed measurement")
    parser.add_argument("--bench-sentences", type=int, default=1000, help="test sentences fastgen-bench decodes")
    parser.add_argument("--repeat", type=int, default=3, help="fastgen-bench timed passes per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the measurements")
    args = parser.parse_args(argv)
    args.clusters = [int(c) for c in args.clusters.split(",")]
    if args.chosen_clusters not in args.clusters:
        parser.error(f"--chosen-clusters {args.chosen_clusters} is not one of --clusters {args.clusters}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    raw, bin_dir, checkpoint = out / "raw", out / "bin", out / "base" / "checkpoint_best.pt"
    step("sentencepiece (en, cs, fr)", raw / "test1.fr", lambda: prepare_text(args, raw))
    bin_dir.mkdir(parents=True, exist_ok=True)
    step("fairseq-preprocess (en-fr, cs-fr; one dictionary)", bin_dir / "test1.cs-fr.fr.bin",
         lambda: binarize_multilingual(raw, bin_dir, PAIRS, test_prefixes=("test", "test1"), workers=2))
    spec = multilingual_spec(base_spec(args), PAIRS)
    step("train the multilingual transformer", checkpoint,
         lambda: toy.train(bin_dir, out / "base", spec, show_progress=True))
    step("Figure 2: states, k-means per scope and cluster count", out / "figure2.json",
         lambda: figure2(args, checkpoint, bin_dir, out))
    for pair in PAIRS:
        step(f"fastgen-bench {pair}", out / f"bench-{pair}" / "results.json",
             lambda pair=pair: bench(args, checkpoint, bin_dir, out, pair))
    report = figure2_table(out) + "\n\n" + bench_table(out, args.chosen_clusters) + "\n"
    (out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
