"""``fastgen-bench --whole-process``: every pass of a configuration is a fresh fairseq-generate process.

What a user waits for: start-up, loading the model, decoding, post-processing
and printing, with the decoder's options as fairseq-generate takes them.  The
configurations are those of an in-process run (decoder x beam x batching x
variant), each the command

    fairseq-generate DATA ...common options... --gen-subset S --beam B --batch-size N \\
        --user-dir fairseq_fastgen --decoder D [variant options]

plus, per beam and batching, stock fairseq-generate without the plugin
(``fairseq/bB/bsN``).  A pass's time is the process's wall time; its CPU time
(user + system) and peak resident memory come from ``wait4``.  The outputs are
the printed D- lines (detokenized best hypotheses), so BLEU and identical
outputs compare what fairseq-generate prints.  Stock fairseq-generate drops
the last batch when its size is not a multiple of ``--required-batch-size-multiple``
(the plugin keeps it): its row then covers fewer sentences, which the table
says in the row, and every row's BLEU and identical share are computed over
the sentences all rows translated (:mod:`fairseq_fastgen.bench.scoring`).
Each process runs in its own process group; when the bench is stopped, the
group of the pass under way is ended.
"""

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fairseq_fastgen.bench import options
from fairseq_fastgen.bench.options import STOCK_PROCESS
from fairseq_fastgen.bench.measure import Candidate
from fairseq_fastgen.commands import PLUGIN_DIR, fairseq_command, stock_fairseq_command

GRACE_S = 30  # how long a stopped fairseq-generate pass may take to end before it is killed
SUMMARY = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\)")


@dataclass
class ProcessPass:
    """One fairseq-generate process: its figures and its printed best hypotheses (the bench times it)."""

    cpu_s: float
    peak_rss_mib: float
    texts: Dict[int, str]  # sentence id -> D- line text of the best hypothesis
    generated_tokens: int
    statistics: dict = field(default_factory=dict)  # --decoder-stats-json of a plugin run


def without_option(argv: List[str], name: str) -> List[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            kept.append(arg)
    return kept


def generate_command(config, bench, stats_path: Optional[str], time_projection: bool = False) -> List[str]:
    """The fairseq-generate command line of one configuration (``time_projection``: its projection timer's)."""
    batching = []
    if config.batch_size is not None:
        batching += ["--batch-size", str(config.batch_size)]
    if config.max_tokens is not None:
        batching += ["--max-tokens", str(config.max_tokens)]
    common = without_option(bench.fairseq_argv, "--user-dir")
    run_options = ["--gen-subset", bench.subset, "--beam", str(config.beam)] + batching
    if config.decoder == STOCK_PROCESS:
        return stock_fairseq_command("generate") + common + run_options
    command = fairseq_command("generate") + common + run_options
    command += ["--user-dir", PLUGIN_DIR, "--decoder", config.decoder, "--decoder-stats-json", stats_path]
    if config.variant is not None:
        command += shlex.split(bench.variant_argv[config.variant])
    if config.cluster_projection:
        command += ["--cluster-projection", bench.cluster_projection]
    if time_projection:
        command.append("--time-projection")  # the baseline of the projection speedup, in a pass of its own
    if options.decodes_with_khead(config, bench):
        command += ["--path", bench.khead_path]  # the last --path wins
    return command


def parse_output(stdout: str, stderr: str = "") -> Tuple[Dict[int, str], int]:
    """Best hypothesis text of every sentence (first D- line of its id) and the generated token count
    (from fairseq's summary, logged to stdout or, when logging was set up before, stderr)."""
    texts = {}
    for line in stdout.splitlines():
        if line.startswith("D-"):
            sentence, _score, text = (line[2:].split("\t", 2) + ["", ""])[:3]
            texts.setdefault(int(sentence), text)
    summary = SUMMARY.search(stdout) or SUMMARY.search(stderr)
    if summary is None:
        raise ValueError("fairseq-generate printed no 'Translated N sentences (T tokens)' summary")
    return texts, int(summary.group(2).replace(",", ""))


def run_process(command: List[str], env: dict, stats_path: Optional[str]) -> ProcessPass:
    if stats_path:
        open(stats_path, "w").close()  # the run writes its statistics here at its end
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        # its own process group: a stop of the bench ends it and every process it started (end_process_group)
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, text=True, start_new_session=True)
        try:
            _, status, usage = os.wait4(process.pid, 0)  # this child's own resource usage
        except BaseException:  # the bench is stopped (SIGTERM, SIGINT) while it waits
            end_process_group(process)
            raise
        exit_code = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        printed, logged = stdout.read(), stderr.read()
    if exit_code != 0:
        message = logged.strip().splitlines()
        raise ValueError(f"fairseq-generate exited with {exit_code}: {message[-1] if message else 'no message'}")
    texts, tokens = parse_output(printed, logged)
    stats = {}
    if stats_path and os.path.getsize(stats_path):
        with open(stats_path) as stats_file:
            stats = json.load(stats_file)
    return ProcessPass(usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, texts, tokens, stats)  # maxrss: KiB


def end_process_group(process, grace_s: float = GRACE_S):
    """SIGTERM to ``process`` and every process of its group (fairseq-generate ends its own workers and reports),
    SIGKILL to the group if it has not ended after ``grace_s`` seconds; returns once ``process`` has ended."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:  # it had ended
        process.wait()


class ProcessPeer:
    """Builds the process candidates of a --whole-process run; their statistics files live in a temporary directory."""

    def __init__(self, bench):
        self.bench = bench
        self.work_dir = tempfile.TemporaryDirectory(prefix="fastgen-bench-")

    def candidate(self, config, time_projection: bool = False) -> "ProcessCandidate":
        return ProcessCandidate(config, self.bench, self.work_dir.name, time_projection)


class ProcessCandidate(Candidate):
    """A configuration run as whole fairseq-generate processes: each reads the subset itself."""

    reads_batches = False

    def __init__(self, config, bench, work_dir: str, time_projection: bool = False):
        self.stats_path = None
        if config.decoder != STOCK_PROCESS:
            name = config.label.replace("/", "_") + (".projection" if time_projection else "")
            self.stats_path = os.path.join(work_dir, name + ".stats.json")
        self.command = generate_command(config, bench, self.stats_path, time_projection)
        self.env = dict(os.environ)
        if bench.threads is not None:
            self.env.update(OMP_NUM_THREADS=str(bench.threads), MKL_NUM_THREADS=str(bench.threads))
        self.passes: List[ProcessPass] = []

    def decode(self, batches) -> Dict[int, str]:
        self.passes.append(run_process(self.command, self.env, self.stats_path))
        return self.passes[-1].texts

    def statistics(self) -> dict:
        return dict(self.passes[-1].statistics)

    def timed_statistics(self) -> dict:
        timed = self.passes[1:] or self.passes
        return {"cpu_seconds": statistics.median(p.cpu_s for p in timed)}

    def memory_report(self) -> dict:
        peak = self.passes[-1].peak_rss_mib
        return {"cpu_peak_rss_mib": round(peak, 1), "cpu_peak_scope": "process"}

    def generated_tokens(self) -> int:
        return self.passes[-1].generated_tokens

    def command_line(self) -> str:
        return shlex.join(self.command)
