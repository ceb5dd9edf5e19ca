"""Table 1 of the blockwise paper on Multi30k, and fastgen-distill's throughput (not part of the product).

Usage (from the repository root, after ``benchmarks/multi30k.py`` built the base model):

    .venv/bin/python benchmarks/multi30k_distill.py --out bench_out/multi30k --bench-dir bench/distill

Steps, each skipped when its output exists (so a rerun resumes):

1. ``fastgen-distill``: the base model's beam-5 translations of the training split,
   as the data-bin OUT/distilled (2 worker processes);
2. throughput: the validation split distilled with 1 and with 2 worker processes;
3. students on top of the base model for every k of ``--k`` and every cell of the
   paper's table: regular or distilled training data (``--task translation_distill
   --distill-mix distilled``) x frozen base (``--freeze-base``) or fine-tuned (the
   whole model trains); all with ``--khead-identity-first`` and ``random_subloss``.
   k = 1 frozen is the base model itself; k = 1 fine-tuned is the base trained for
   as many updates more as the other fine-tuned students. Named in ``--students``
   only, students on "greedy" data: the base's own float32 greedy translations of the
   training split (OUT/distilled-greedy, made before the first of them), the tokens
   exact blockwise decoding accepts against;
4. ``fastgen-bench`` on the test split for each model (greedy and blockwise, beam 1,
   batch 64), then the table: BLEU and mean accepted block size per cell;
5. ``speed`` (not in the default stages; run it with the machine otherwise idle):
   ``fastgen-bench`` of every trained model at batch 1 and 64, one thread, three
   timed passes, greedy and blockwise of the same model in the same run (with
   oneDNN's products and int8 proposals: each decoder at its fastest), then the
   table of sentences/s and blockwise against greedy per model.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multi30k import (  # noqa: E402  (the base model's settings)
    STUDENT_CRITERION,
    add_base_model_options,
    console_script,
    resolve_size,
    step,
    student_spec,
    train_step,
)

from fastgen_demo import toy  # noqa: E402

DATA_KINDS = ("regular", "distilled")  # the paper's table
# the base's own greedy translations: what a frozen base's heads 2..k must guess for exact acceptance (not in the table)
GREEDY_DATA = "greedy"
REGIMES = ("frozen", "finetuned")


def run_logged(command, log_path, env=None):
    with open(log_path, "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)


def distill(bin_dir, teacher, output_dir, split, workers, log_path, teacher_args=(), beam=5):
    """Run fastgen-distill (one torch thread per worker) and return its summary."""
    run_logged([console_script("fastgen-distill"), str(bin_dir), "--path", str(teacher), "--split", split,
                "--output-dir", str(output_dir), "--workers", str(workers), "--beam", str(beam), "--batch-size", "64",
                "--cpu", *teacher_args], log_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads((Path(output_dir) / f"distill.{split}.json").read_text())


def greedy_translations(bin_dir, base, output_dir, bench_dir):
    """The base's float32 greedy translations of the training split in ``output_dir`` (made when missing): the
    compiled engine gives fairseq's float32 tokens, the ones exact blockwise decoding of a frozen base gives."""
    step("fastgen-distill train, greedy (2 workers)", output_dir / "distill.train.json",
         lambda: distill(bin_dir, base, output_dir, "train", 2, bench_dir / "distill-train-greedy.log",
                         ("--step-engine", "compiled"), beam=1))


def cell_name(k, regime, data_kind):
    return f"k{k}-{regime}-{data_kind}"


def train_student(args, bin_dir, save_dir, base, k, regime, data_kind, distilled_dir, restore=None):
    """fairseq-train one student; ``restore``: fine-tune this (frozen) student's checkpoint."""
    extra = ["--subloss-mode", args.finetune_subloss_mode] if regime == "finetuned" else []
    if restore is not None and args.finetune_proposal_vocab:  # a --two-stage student: its name says -listed
        extra += ["--proposal-vocab", str(Path(args.finetune_proposal_vocab).resolve())]
    if restore is not None and args.finetune_first_head_weight is not None:  # its name says -firstW
        extra += ["--first-head-weight", str(args.finetune_first_head_weight)]
    if args.khead_ffn_dim:
        extra += ["--khead-ffn-dim", str(args.khead_ffn_dim)]
    if data_kind != "regular":  # distilled_dir: that kind's translations of the training split
        extra += ["--task", "translation_distill", "--distilled-data", str(distilled_dir), "--distill-mix", "distilled"]
    if restore is not None:  # fairseq starts from it on the first launch only: a stopped run resumes from its own
        extra += ["--finetune-from-model", str(Path(restore).resolve())]
    if regime == "frozen":
        lr, updates = args.frozen_lr, args.student_updates
    else:
        lr, updates = args.finetune_lr, args.finetune_updates
    validate_interval = 1 if restore is not None else 1000  # a long second stage saves every epoch
    spec = student_spec(args, base, k, lr, updates, freeze_base=regime == "frozen", extra_args=extra,
                        validate_interval=validate_interval)
    toy.train(bin_dir, save_dir, spec, show_progress=True, criterion_args=STUDENT_CRITERION, device=args.device)


def cells(ks, data_kinds=DATA_KINDS):
    """(k, regime, data kind) of every student to train; k = 1 frozen is the base itself."""
    return [(k, regime, data_kind) for regime in REGIMES for k in ks for data_kind in data_kinds
            if not (k == 1 and regime == "frozen")]


def listed_decoding(args, name):
    """fastgen-bench options of student ``name``: a student fine-tuned with --finetune-proposal-vocab (suffix
    -listed) proposes among the same list, on int8 proposals (the list needs them)."""
    if "-listed" not in name or not args.finetune_proposal_vocab:
        return ()
    return ("--blockwise-int8-proposals", "--blockwise-proposal-vocab", str(args.finetune_proposal_vocab))


def bench_command(bin_dir, checkpoint, output_dir, threads, batch_sizes="64", repeat=1, extra=()):
    return [console_script("fastgen-bench"), str(bin_dir), "--path", str(checkpoint), "--cpu", "--threads", str(threads),
            "--post-process", "sentencepiece", "--decoders", "greedy,blockwise", "--beam", "1",
            "--batch-size", batch_sizes, "--repeat", str(repeat), "--reference", "greedy", "--no-ctranslate2",
            "--output-dir", str(output_dir), *extra]


def speed_command(bin_dir, checkpoint, output_dir, extra=()):
    """The speed stage's bench: batch 1 and 64, three timed passes, one thread, each decoder at its fastest."""
    return bench_command(bin_dir, checkpoint, output_dir, threads=1, batch_sizes="1,64", repeat=3,
                         extra=("--onednn-linear", "--blockwise-int8-proposals", *extra))


def speed_rows(name, results_path):
    """Table rows (one per batch size) of a speed bench: BLEU, block, sentences/s of greedy and blockwise."""
    runs = json.loads(results_path.read_text())["configurations"]
    rows = []
    for batch_size in sorted({run["batch_size"] for run in runs}):
        by_decoder = {run["decoder"]: run for run in runs
                      if run["batch_size"] == batch_size and run["status"] == "ok" and not run["variant"]}
        greedy, blockwise = by_decoder["greedy"], by_decoder.get("blockwise")
        cells = [name, str(batch_size), f"{greedy['sentences_per_second']['median']:.1f}"]
        if blockwise is None:  # a stock transformer: greedy only
            cells += ["", "", f"{greedy['bleu']:.2f}", "1.00", ""]
        else:
            speed = blockwise["sentences_per_second"]["median"]
            cells += [f"{speed:.1f}", f"**{speed / greedy['sentences_per_second']['median']:.2f}x**",
                      f"{blockwise['bleu']:.2f}", f"{blockwise['statistics']['mean_accepted_block_size']:.2f}",
                      f"{100 * blockwise['identical_rate']:.1f}%"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def print_speed_table(names, speed_dir):
    print("| model | batch | greedy sentences/s | blockwise sentences/s | blockwise / greedy | BLEU | mean accepted "
          "block | identical to greedy |")
    print("|---" * 8 + "|")
    for name in names:
        results = speed_dir / name / "results.json"
        if results.exists():
            print("\n".join(speed_rows(name, results)))


def cell_text(results_path):
    """'BLEU / mean accepted block size' of blockwise decoding; greedy (block 1) for a stock transformer."""
    if not results_path.exists():
        return "not run"
    configs = {config["decoder"]: config for config in json.loads(results_path.read_text())["configurations"]}
    blockwise = configs.get("blockwise")
    if blockwise is None or blockwise.get("status") != "ok":
        return f"{configs['greedy']['bleu']:.2f} / 1.00 (greedy)"
    return (f"{blockwise['bleu']:.2f} / {blockwise['statistics']['mean_accepted_block_size']:.2f}"
            f" ({100 * blockwise['identical_rate']:.0f}% = greedy)")


def print_table(ks, bench_dir, suffix=""):
    columns = [(data_kind, regime) for regime in REGIMES for data_kind in DATA_KINDS]
    print("| k | " + " | ".join(f"{data_kind}, {regime}" for data_kind, regime in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for k in sorted(ks):
        texts = []
        for data_kind, regime in columns:
            name = "k1-base" if (k == 1 and regime == "frozen") else cell_name(k, regime, data_kind) + suffix
            texts.append(cell_text(bench_dir / name / "results.json"))
        print(f"| {k} | " + " | ".join(texts) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/multi30k", help="working directory of benchmarks/multi30k.py")
    parser.add_argument("--bench-dir", default="bench/distill", help="fastgen-bench outputs")
    parser.add_argument("--k", default="1,2,4,8", help="comma-separated block sizes")
    parser.add_argument("--student-updates", type=int, default=300, help="updates of a frozen-base student")
    parser.add_argument("--finetune-updates", type=int, default=200, help="updates of a fine-tuned student")
    parser.add_argument("--frozen-lr", type=float, default=0.002)
    parser.add_argument("--finetune-lr", type=float, default=0.0005)
    parser.add_argument("--two-stage", default=None, metavar="K-DATA",
                        help="also fine-tune the frozen student kK-frozen-DATA (e.g. 4-regular; several: comma-separated) "
                             "from its checkpoint "
                             "into kK-frozen-then-finetuned-DATA (--finetune-lr, --finetune-updates); the docs "
                             "table used --finetune-lr 0.0001 --finetune-updates 150")
    parser.add_argument("--finetune-subloss-mode", choices=["random", "mean"], default="random",
                        help="random_subloss --subloss-mode of the fine-tuned students; a two-stage student "
                             "trained with mean gets the suffix -mean")
    parser.add_argument("--finetune-first-head-weight", type=float, default=None, metavar="W",
                        help="the --two-stage students' random_subloss --first-head-weight (mean mode: head 1's "
                             "share of the loss); their names get the suffix -firstW")
    parser.add_argument("--finetune-proposal-vocab", default=None, metavar="FILE",
                        help="the --two-stage students' heads 2..k learn to choose among FILE's tokens only "
                             "(random_subloss --proposal-vocab: about a third of a k = 8 update's time at 32k "
                             "tokens); their names get the suffix -listed, and they are benched with "
                             "--blockwise-proposal-vocab FILE")
    parser.add_argument("--students", default=None,
                        help="comma-separated students to train, in this order (e.g. k8-frozen-regular,"
                             "k4-finetuned-distilled); default: every cell, frozen ones first")
    parser.add_argument("--khead-ffn-dim", type=int, default=None,
                        help="every student's --khead-ffn-dim (a narrower k-head layer: cheaper iterations); their "
                             "names get the suffix -ffnN")
    parser.add_argument("--stages", default="distill,throughput,students,bench",
                        help="comma-separated stages to run (distill, throughput, students, bench; speed: "
                             "batch 1 and 64 timings of every trained model, --bench-dir/speed)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of fastgen-bench")
    parser.add_argument("--teacher-args", default="",
                        help="more fastgen-distill options for the training split (e.g. \"--quantize int8 "
                             "--step-engine compiled\": the base-size teacher in int8, about 3x float32's speed)")
    add_base_model_options(parser)  # as benchmarks/multi30k.py built the base model
    args = resolve_size(parser.parse_args(argv))
    out, bench_dir = Path(args.out), Path(args.bench_dir)
    bin_dir, base, distilled = out / "bin", out / "base" / "checkpoint_best.pt", out / "distilled"
    data_dirs = {"regular": None, "distilled": distilled, GREEDY_DATA: out / "distilled-greedy"}
    ks = [int(k) for k in args.k.split(",")]
    wanted = args.stages.split(",")
    bench_dir.mkdir(parents=True, exist_ok=True)

    if "distill" in wanted:
        step("fastgen-distill train (2 workers)", distilled / "distill.train.json",
             lambda: distill(bin_dir, base, distilled, "train", 2, bench_dir / "distill-train.log",
                             args.teacher_args.split()))
    if "throughput" in wanted:
        for workers in (1, 2):
            target = out / f"distill-valid-{workers}w"
            step(f"fastgen-distill valid ({workers} worker(s))", target / "distill.valid.json",
                 lambda workers=workers, target=target: distill(bin_dir, base, target, "valid", workers,
                                                                bench_dir / f"distill-valid-{workers}w.log"))
        for workers in (1, 2):
            summary = json.loads((out / f"distill-valid-{workers}w" / "distill.valid.json").read_text())
            print(f"   valid, {workers} worker(s): {summary['sentences']} sentences, {summary['sentences_per_second']:.1f} "
                  f"sentences/s decoding, {summary['wall_seconds']:.1f} s wall, teacher BLEU {summary['teacher_bleu']:.2f}",
                  flush=True)
    suffix = f"-ffn{args.khead_ffn_dim}" if args.khead_ffn_dim else ""  # students of a narrower k-head layer
    students = {cell_name(*cell) + suffix: cell for cell in cells(ks)}
    order = list(students)
    students.update({cell_name(*cell) + suffix: cell for cell in cells(ks, (GREEDY_DATA,))})
    if args.students:
        order = args.students.split(",")
        unknown = [name for name in order if name not in students]
        if unknown:
            parser.error(f"--students: unknown {', '.join(unknown)}; known: {', '.join(students)}")
    if "students" in wanted:
        for name in order:
            k, regime, data_kind = students[name]
            save_dir = out / "table1" / name
            if data_kind == GREEDY_DATA:
                greedy_translations(bin_dir, base, data_dirs[GREEDY_DATA], bench_dir)
            train_step(f"student {name}", save_dir, save_dir / "checkpoint_last.pt",
                       lambda k=k, regime=regime, data_kind=data_kind, save_dir=save_dir: train_student(
                           args, bin_dir, save_dir, base, k, regime, data_kind, data_dirs[data_kind]))
    models = [("k1-base", base)] + [(name, out / "table1" / name / "checkpoint_last.pt") for name in students
                                    if students[name][2] != GREEDY_DATA or (out / "table1" / name).exists()]
    for two_stage in args.two_stage.split(",") if args.two_stage else []:
        k, data_kind = two_stage.split("-")
        name = f"k{k}-frozen-then-finetuned-{data_kind}"
        if args.finetune_subloss_mode == "mean":
            name += "-mean"
        if args.finetune_first_head_weight is not None:
            name += f"-first{args.finetune_first_head_weight:g}"
        if args.finetune_proposal_vocab:
            name += "-listed"
        name += suffix
        checkpoint = out / "table1" / name / "checkpoint_last.pt"
        models.insert(0, (name, checkpoint))
        if "students" in wanted:
            frozen = out / "table1" / (cell_name(k, "frozen", data_kind) + suffix) / "checkpoint_last.pt"
            train_step(f"student {name}", out / "table1" / name, checkpoint,
                       lambda k=k, data_kind=data_kind, name=name, frozen=frozen: train_student(
                           args, bin_dir, out / "table1" / name, base, int(k), "finetuned", data_kind,
                           data_dirs[data_kind], restore=frozen))
    if "bench" in wanted:
        for name, checkpoint in models:
            if not checkpoint.exists():
                print(f"== fastgen-bench {name}: no model yet ({checkpoint})", flush=True)
                continue
            step(f"fastgen-bench {name}", bench_dir / name / "results.json",
                 lambda checkpoint=checkpoint, name=name: run_logged(
                     bench_command(bin_dir, checkpoint, bench_dir / name, args.threads,
                                   extra=listed_decoding(args, name)),
                     bench_dir / f"{name}.log"))
        print_table(ks, bench_dir, suffix)
    if "speed" in wanted:
        trained = sorted(((name, checkpoint) for name, checkpoint in models if checkpoint.exists()),
                         key=lambda model: (int(model[0][1:model[0].index("-")]), model[0]))  # by k, frozen first
        speed_dir = bench_dir / "speed"
        speed_dir.mkdir(exist_ok=True)
        for name, checkpoint in trained:
            step(f"fastgen-bench {name}, batch 1 and 64", speed_dir / name / "results.json",
                 lambda checkpoint=checkpoint, name=name: run_logged(
                     speed_command(bin_dir, checkpoint, speed_dir / name, listed_decoding(args, name)),
                     speed_dir / f"{name}.log"))
        print_speed_table([name for name, _ in trained], speed_dir)


if __name__ == "__main__":
    main()
