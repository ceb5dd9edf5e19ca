"""fastgen-bench --plot-sizes: speed against model size from runs already made, beside CTranslate2.

    fastgen-bench --plot-sizes sizes.png toy=bench/toy base=bench/base big=bench/big

reads one fastgen-bench ``results.json`` per model size (the file, or the
``--output-dir`` holding it), the sizes in the order given along the x axis,
and draws one line per configuration (the results' own labels:
decoder/beam/batching[/cp][/variant]) of its sentences/s, the median of its
timed passes, on a log axis; CTranslate2's configurations dashed and black.
Where CTranslate2 was measured, a second panel gives each configuration's speed
over CTranslate2's at the same beam and batching on the same model.  A size's
x label names its model's layers, width and parameters where its results.json
records them (``model``; older files lack it): ``base (6+6, 512, 61M)``.

The same figures are returned as a Markdown table (configuration x size).
A misuse (an argument that is not NAME=RESULTS, a missing file, a file that is
not a fastgen-bench results.json, fewer than two sizes) raises UsageError.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fairseq_fastgen.bench.options import CTRANSLATE2, BenchConfig
from fairseq_fastgen.option_checks import UsageError
from fairseq_fastgen.safe_files import write_atomically

RESULTS_FILE = "results.json"


@dataclass
class SizeRun:
    """One model size: its name on the x axis and what its results.json says."""

    name: str
    model: Optional[dict]  # results.json's "model": parameters, encoder_layers, decoder_layers, width
    labels: List[str]  # every configuration of the run, in its order (a skipped one too)
    speeds: Dict[str, float]  # label -> sentences/s (median), measured configurations only
    ctranslate2: Dict[str, str]  # label -> label of CTranslate2's configuration at its beam and batching

    def ratio(self, label: str) -> Optional[float]:
        """The configuration's speed over CTranslate2's at the same beam and batching, where both were measured."""
        peer = self.ctranslate2.get(label)
        if peer is None or label not in self.speeds or peer not in self.speeds:
            return None
        return self.speeds[label] / self.speeds[peer]


# ---- reading -------------------------------------------------------------------------------------
def results_file(spec: str) -> Tuple[str, Path]:
    """``NAME=RESULTS`` -> (name, path of its results.json)."""
    name, separator, given = spec.partition("=")
    if not separator or not name or not given:
        raise UsageError(f"--plot-sizes {spec!r}: expected NAME=RESULTS (a results.json or the directory holding it)")
    path = Path(given)
    path = path / RESULTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"--plot-sizes {spec}: {path} does not exist")
    return name, path


def read_run(name: str, path: Path) -> SizeRun:
    try:
        results = json.loads(path.read_text())
        if results.get("tool") != "fastgen-bench":
            raise ValueError("its 'tool' is not fastgen-bench")
        records = results["configurations"]
        run_labels = [r["label"] for r in records]
        speeds = {r["label"]: r["sentences_per_second"]["median"] for r in records if r["status"] == "ok"}
        ctranslate2 = {  # built as the bench labels its configurations, so the labels cannot drift apart
            r["label"]: BenchConfig(CTRANSLATE2, r["beam"], r["batch_size"], r["max_tokens"]).label
            for r in records if r["decoder"] != CTRANSLATE2
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # json's errors are ValueErrors
        reason = f"{type(error).__name__}: {error}" if isinstance(error, KeyError) else str(error)
        raise UsageError(f"--plot-sizes {name}={path}: not a fastgen-bench results.json ({reason})") from None
    return SizeRun(name, results.get("model"), run_labels, speeds, ctranslate2)


def read_runs(specs: List[str]) -> List[SizeRun]:
    files = [results_file(spec) for spec in specs]
    names = [name for name, _ in files]
    if len(files) < 2:
        raise UsageError(f"--plot-sizes needs at least 2 sizes (NAME=RESULTS after the PNG file), got {len(files)}")
    if len(set(names)) < len(names):
        raise UsageError(f"--plot-sizes: each size needs a name of its own, got {', '.join(names)}")
    return [read_run(name, path) for name, path in files]


def labels(runs: List[SizeRun]) -> List[str]:
    """Every configuration of every size, in the order the runs list them (a label first met in a later run after
    the earlier runs' labels)."""
    return list(dict.fromkeys(label for run in runs for label in run.labels))


def is_ctranslate2(label: str) -> bool:
    return label.split("/")[0] == CTRANSLATE2


# ---- text ----------------------------------------------------------------------------------------
def count(number: int) -> str:
    """61_234_567 -> '61.2M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if number >= scale:
            return f"{number / scale:.3g}{unit}"
    return str(number)


def size_label(run: SizeRun) -> str:
    """'base (6+6, 512, 61M)': layers, width and parameters where results.json has them, else the name."""
    model = run.model or {}
    parts = []
    if model.get("encoder_layers") is not None and model.get("decoder_layers") is not None:
        parts.append(f"{model['encoder_layers']}+{model['decoder_layers']}")
    if model.get("width") is not None:
        parts.append(str(model["width"]))
    if model.get("parameters") is not None:
        parts.append(count(model["parameters"]))
    return f"{run.name} ({', '.join(parts)})" if parts else run.name


def cell(run: SizeRun, label: str) -> str:
    if label not in run.labels:
        return ""
    if label not in run.speeds:
        return "skipped"
    ratio = run.ratio(label)
    return f"{run.speeds[label]:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def markdown_table(runs: List[SizeRun]) -> str:
    """Configuration x size: sentences/s (median), and in brackets the speed over CTranslate2's at the same beam
    and batching on that model."""
    header = ["configuration"] + [size_label(run) for run in runs]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows += ["| " + " | ".join([label] + [cell(run, label) for run in runs]) + " |" for label in labels(runs)]
    return ("sentences/s (median of the timed passes); (Nx): against CTranslate2 at the same beam and batching\n\n"
            + "\n".join(rows))


# ---- plot ----------------------------------------------------------------------------------------
def plot(path: Path, runs: List[SizeRun]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    every = labels(runs)
    panels = 2 if any(run.ratio(label) is not None for label in every for run in runs) else 1  # 2: CT2 measured
    figure, axes = pyplot.subplots(1, panels, figsize=(6 * panels + 3, 5.5), squeeze=False, layout="constrained")
    speed_axes, ratio_axes = axes[0][0], axes[0][-1]
    colours = pyplot.get_cmap("tab10" if len(every) <= 10 else "tab20").colors
    ctranslate2_markers = iter("s^vD<>p*" * len(every))
    positions = range(len(runs))
    for index, label in enumerate(every):
        if is_ctranslate2(label):
            style = dict(color="black", linestyle="--", marker=next(ctranslate2_markers), linewidth=2)
        else:
            style = dict(color=colours[index % len(colours)], linestyle="-", marker="o")
        measured = [(x, run.speeds[label]) for x, run in zip(positions, runs) if label in run.speeds]
        if measured:  # a size where the configuration was not measured leaves a gap in its line
            speed_axes.plot(*zip(*measured), label=label, **style)
        ratios = [(x, run.ratio(label)) for x, run in zip(positions, runs) if run.ratio(label) is not None]
        if panels == 2 and ratios:
            ratio_axes.plot(*zip(*ratios), **style)
    speed_axes.set_ylabel("sentences / s, median of warm passes (log)")
    speed_axes.set_title("speed against model size", fontsize=9)
    if panels == 2:
        ratio_axes.axhline(1.0, color="black", linestyle="--", linewidth=2)
        ratio_axes.set_ylabel("speed / CTranslate2's at the same beam and batching (log)")
        ratio_axes.set_title("against CTranslate2 (dashed: its speed)", fontsize=9)
    for axis in axes[0]:  # speeds and their ratios on log axes, labelled 0.5, 2, 40 rather than 4x10^1
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axis.tick_params(axis="y", which="minor", labelsize=7)
        axis.set_xticks(list(positions), [size_label(run) for run in runs], fontsize=8)
        axis.set_xlim(-0.3, len(runs) - 0.7)  # every size, measured in this panel or not
        axis.set_xlabel("model size")
        axis.grid(True, alpha=0.3)
    figure.legend(loc="outside right upper", fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: figure.savefig(f, format="png", dpi=120))
    pyplot.close(figure)
    return path


def plot_sizes(output: str, specs: List[str]) -> str:
    """Read each NAME=RESULTS, write the plot to ``output`` (a .png file); returns the Markdown table."""
    if not output.endswith(".png") or "=" in output:
        raise UsageError(f"--plot-sizes OUT.png NAME=RESULTS NAME=RESULTS...: the first argument is the PNG file to "
                         f"write, got {output!r}")
    runs = read_runs(specs)
    path = plot(Path(output), runs)
    return markdown_table(runs) + f"\n\nPlot: {path}"
