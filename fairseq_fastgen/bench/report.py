"""What the bench writes: a Markdown table, results.json and a BLEU-against-speed plot."""

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_fastgen.bench.measure import ConfigResult, as_text
from fairseq_fastgen.safe_files import write_atomically

# counters that the table leaves to results.json (sizes of the run, not of the decoder)
UNTABULATED_STATISTICS = ("decoder", "sentences", "tokens", "projection_seconds", "projection_states")
PLOT_FILE = "bleu_vs_speed.png"


# ---- JSON ------------------------------------------------------------------------------------
def config_record(result: ConfigResult, hypotheses: Optional[Path]) -> dict:
    config = result.config
    record = {
        "label": config.label,
        "decoder": config.decoder,
        "beam": config.beam,
        "batch_size": config.batch_size,
        "max_tokens": config.max_tokens,
        "cluster_projection": config.cluster_projection,
        "variant": config.variant,
        "status": "ok" if result.ok else "skipped",
    }
    if not result.ok:
        record["reason"] = result.skipped
        return record
    record.update(
        sentences=len(result.outputs),
        generated_tokens=result.tokens,
        seconds=result.seconds,
        sentences_per_second=result.sentences_per_second(),
        tokens_per_second=result.tokens_per_second(),
        total_sentences=result.total_sentences,
        compared_sentences=result.compared_sentences,  # set: bleu and identical_rate are over these only
        bleu=result.bleu,
        bleu_own_sentences=result.own_bleu,
        reference=result.reference,
        identical_rate=result.identical_rate,
        memory=result.memory,
        statistics=result.statistics,
        hypotheses=str(hypotheses),
    )
    if result.command is not None:
        record["command"] = result.command
    return record


def write_json(path: Path, results: List[ConfigResult], run_info: dict, hypotheses: Dict[str, Path]):
    records = [config_record(r, hypotheses.get(r.config.label)) for r in results]
    text = json.dumps(dict(run_info, configurations=records), indent=2) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))  # a killed bench leaves no partial results.json


def write_hypotheses(output_dir: Path, results: List[ConfigResult], detokenize) -> Dict[str, Path]:
    """hypotheses/LABEL.txt per measured configuration: ``id<TAB>detokenized best hypothesis``."""
    directory = output_dir / "hypotheses"
    directory.mkdir(exist_ok=True)
    paths = {}
    for result in results:
        if result.ok:
            path = directory / (result.config.label.replace("/", "_") + ".txt")
            text = "".join(f"{i}\t{as_text(result.outputs[i], detokenize)}\n" for i in sorted(result.outputs))
            write_atomically(path, lambda f: f.write(text.encode("utf-8")))
            paths[result.config.label] = path
    return paths


# ---- Markdown ----------------------------------------------------------------------------------
def _number(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def statistics_cell(statistics: dict) -> str:
    shown = {k: v for k, v in statistics.items() if k not in UNTABULATED_STATISTICS}
    return ", ".join(f"{k}={_number(v)}" for k, v in shown.items())


def memory_cell(memory: dict) -> str:
    cell = f"{memory['cpu_peak_rss_mib']:.0f}"
    if "cpu_rss_growth_mib" in memory:  # not for a whole process, which starts from nothing
        cell += f" (+{memory['cpu_rss_growth_mib']:.0f})"
    if "cuda_max_allocated_mib" in memory:
        cell += f"; CUDA {memory['cuda_max_allocated_mib']:.0f}"
    return cell


COMMON_MARK = "†"  # a BLEU or identical share over the sentences every configuration translated


def identical_cell(result: ConfigResult) -> str:
    if result.reference is None:
        return ""
    if result.reference == result.config.label:
        return "(reference)"
    mark = COMMON_MARK if result.compared_sentences is not None else ""
    return f"{100 * result.identical_rate:.1f}%{mark} {result.reference}"


def bleu_cell(result: ConfigResult) -> str:
    if result.bleu is None:
        return ""
    return f"{result.bleu:.2f}" + (COMMON_MARK if result.compared_sentences is not None else "")


def configuration_cell(result: ConfigResult) -> str:
    """The label, and how many sentences the configuration translated when that is fewer than the subset."""
    translated, total = len(result.outputs), result.total_sentences
    if result.ok and total is not None and translated < total:
        return f"{result.config.label} (only {translated} of {total} sentences)"
    return result.config.label


def coverage_note(results: List[ConfigResult]) -> Optional[str]:
    """Under the table, when the configurations translated different sentences: what the marked cells cover."""
    compared = [r for r in results if r.ok and r.compared_sentences is not None]
    if not compared:
        return None
    counts = ", ".join(f"{r.config.label} {len(r.outputs)}" for r in compared)
    first = compared[0]
    return (f"{COMMON_MARK} The configurations translated different sentences ({counts}): BLEU and identical "
            f"outputs marked {COMMON_MARK} are over the {first.compared_sentences} of {first.total_sentences} "
            "sentences that every one translated; speeds are over each configuration's own sentences. "
            "results.json also has each BLEU over its own sentences (bleu_own_sentences).")


def markdown_table(results: List[ConfigResult]) -> str:
    header = ["configuration", "sentences/s median (min-max)", "tokens/s median", "BLEU",
              "identical to", "peak RSS MiB (+growth)", "decoder statistics"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        if not result.ok:
            cells = [configuration_cell(result), f"skipped: {result.skipped}", "", "", "", "", ""]
        else:
            sentences, tokens = result.sentences_per_second(), result.tokens_per_second()
            cells = [
                configuration_cell(result),
                f"{sentences['median']:.1f} ({sentences['min']:.1f}-{sentences['max']:.1f})",
                f"{tokens['median']:.0f}",
                bleu_cell(result),
                identical_cell(result),
                memory_cell(result.memory),
                statistics_cell(result.statistics),
            ]
        rows.append("| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |")
    note = coverage_note(results)
    return "\n".join(rows) + (f"\n\n{note}" if note else "")


def projection_table(results: List[ConfigResult]) -> Optional[str]:
    """Each configuration that timed its vocabulary projection against its reference (the cluster
    projection's figures: step time and end-to-end speed ratios, identical outputs, BLEU difference);
    None when no configuration has both."""
    measured = {r.config.label: r for r in results if r.ok}
    compared = [r for r in measured.values() if "projection_speedup" in r.statistics and r.reference in measured]
    if not compared:
        return None
    header = ["configuration", "against", "active vocabulary mean (max)", "projection ms/step",
              "projection speedup", "sentences/s ratio", "identical", "BLEU difference"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in compared:
        reference, stats = measured[result.reference], result.statistics
        speed_ratio = result.sentences_per_second()["median"] / reference.sentences_per_second()["median"]
        bleu = "" if result.bleu is None else f"{result.bleu - reference.bleu:+.2f}"
        cells = [
            result.config.label, result.reference,
            f"{100 * stats['projection_active_fraction_mean']:.1f}% ({100 * stats['projection_active_fraction_max']:.1f}%)",
            f"{stats['projection_ms_per_step']:.3f} vs {reference.statistics['projection_ms_per_step']:.3f}",
            f"{stats['projection_speedup']:.2f}x", f"{speed_ratio:.2f}x", f"{100 * result.identical_rate:.1f}%", bleu,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- plot ----------------------------------------------------------------------------------------
def pareto_frontier(points):
    """Indices of the (speed, bleu) points that no other point beats on both (faster first)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    frontier, best_bleu = [], None
    for i in order:
        if best_bleu is None or points[i][1] > best_bleu:
            frontier.append(i)
            best_bleu = points[i][1]
    return frontier


def plot_bleu_against_speed(path: Path, results: List[ConfigResult], title: str) -> Optional[Path]:
    """One point per measured configuration (horizontal bar: min-max speed); Pareto frontier marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    plotted = [r for r in results if r.ok and r.bleu is not None]
    if not plotted:
        return None
    speeds = [r.sentences_per_second() for r in plotted]
    points = [(s["median"], r.bleu) for s, r in zip(speeds, plotted)]
    frontier = pareto_frontier(points)
    figure, axes = pyplot.subplots(figsize=(8, 5.5))
    for index, ((speed, bleu), rate, result) in enumerate(zip(points, speeds, plotted)):
        on_frontier = index in frontier
        axes.errorbar(
            speed, bleu, xerr=[[speed - rate["min"]], [rate["max"] - speed]], fmt="o" if on_frontier else "s",
            color="tab:red" if on_frontier else "tab:blue", markerfacecolor="tab:red" if on_frontier else "none",
            capsize=3,
        )
        # configurations of equal BLEU (e.g. identical outputs) get their labels stacked, not overprinted
        same_bleu_before = sum(1 for other in points[:index] if math.isclose(other[1], bleu, abs_tol=0.05))
        axes.annotate(result.config.label, (speed, bleu), textcoords="offset points",
                      xytext=(5, 4 + 9 * same_bleu_before), fontsize=7)
    front = sorted(points[i] for i in frontier)
    axes.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:red", label="Pareto frontier")
    if max(p[0] for p in points) > 10 * min(p[0] for p in points):
        axes.set_xscale("log")
    axes.set_xlabel("sentences / s (median of warm passes; bar: min-max)")
    axes.set_ylabel("BLEU (sacrebleu, detokenized)")
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.margins(x=0.15, y=0.15)
    axes.legend(loc="best")
    figure.tight_layout()
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=120))
    pyplot.close(figure)
    return path
