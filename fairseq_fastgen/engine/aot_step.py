"""Compiled engine steps compiled ahead of time and kept on disk (AOTInductor).

On the CPU, steps of more rows than the fixed-shape buckets of ``compiled.py``
run one compiled unit whose row count, target capacity and source width are
symbolic: the decoder step's padded form and its log-softmax, exported with
``torch.export`` and compiled by AOTInductor with the weights frozen.  Frozen
weights with symbolic rows make inductor compute every product by oneDNN's
prepacked fp32 kernel (with fixed rows it picks MKL's, slower on AMD CPUs),
the bias and residual added in the same call, and fuse the work between
the products into C++ loops.  With ``--compiled-freezing`` each row bucket
(1, 2, 4 rows) is such a unit too, its rows fixed and its products inductor's
C++ GEMM template.

torch.compile cannot keep such a unit between processes (its graph cache
refuses the packed weights), so the unit is written as an AOTInductor package,
named by a SHA-256 of everything it depends on (torch's version, this engine's
source, the decoder's settings and the bytes of its weights), into
``$FASTGEN_COMPILED_DIR`` (default: ``fairseq_fastgen`` in inductor's cache
directory, ``$TORCHINDUCTOR_CACHE_DIR`` or ``/tmp/torchinductor_$USER``).  The
first process compiles it (slow), later ones only load it (quick); a process
that finds another compiling the same package waits for
it (a file lock), and a package is written under a temporary name and renamed.
Processes sharing inductor's cache directory compile one package of a program
at a time (AOTInductor rewrites a graph's generated files there in place).
With ``--compile-in-background`` a forked child compiles a package that is not
on disk while the decode runs those steps eager (:class:`BackgroundCompilation`).

A package is described by a :class:`StepPackage` (the padded step, for rows,
beams or a block of positions per row) or an :class:`EncoderPackage` (the
encoder, ``encoder_pass.py``, its source length symbolic): its file, the
program it exports and inductor's settings.
"""

import functools
import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from filelock import FileLock  # torch's own dependency
from torch import nn

from fairseq_fastgen import safe_files
from fairseq_fastgen.engine.compiled_step import PaddedStep
from fairseq_fastgen.engine.encoder_pass import EncoderPass
from fairseq_fastgen.engine.loaded_package import load_package
from fairseq_fastgen.engine.unlocked_loader import loader_class

COMPILED_DIR_ENV = "FASTGEN_COMPILED_DIR"
ENGINE_SOURCES = ("decoder_step.py", "block_rows.py", "compiled_step.py", "fused_weights.py", "layer_weights.py",
                  "int8_weights.py", "bf16_weights.py", "f32_rows_weights.py", "aot_step.py")


def inductor_cache_dir() -> Path:
    """Inductor's cache directory: ``$TORCHINDUCTOR_CACHE_DIR`` or ``/tmp/torchinductor_$USER``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def compiled_dir() -> Path:
    configured = os.environ.get(COMPILED_DIR_ENV)
    if configured:
        return Path(configured)
    return inductor_cache_dir() / "fairseq_fastgen"


def example_inputs(step: PaddedStep, position_table, rows: Optional[int]):
    """Inputs of the step at sizes no other dimension has (so that tracing ties none of them together); with
    ``beams`` > 1, 7 sentences of ``beams`` rows, the encoder-decoder inputs per sentence; with ``block`` > 1,
    that many positions per row (tokens and positions (rows, block))."""
    beams, block = step.beams, step.block
    sentences = 7 if beams > 1 else None
    rows, capacity, width = rows or (sentences * beams if sentences else 5), 40, 24
    sources = sentences or rows
    decoder_step = step.decoder_step
    weight = next(decoder_step.parameters())

    def buffers(count: int, length: int):  # per layer (count, heads, length, head_dim)
        shape = (count, decoder_step.heads, length, decoder_step.head_dim)
        return [weight.new_zeros(shape) for _ in range(decoder_step.num_layers)]

    tokens = torch.full((rows, block), decoder_step.decoder.dictionary.eos(), dtype=torch.long, device=weight.device)
    positions = torch.zeros((rows, block) if block > 1 else (rows,), dtype=torch.long, device=weight.device)
    attended = torch.zeros(rows, capacity, dtype=torch.bool, device=weight.device)
    return (tokens, positions, attended, position_table,
            buffers(rows, capacity), buffers(rows, capacity), buffers(sources, width), buffers(sources, width),
            torch.zeros(sources, width, dtype=torch.bool, device=weight.device), decoder_step.token_table())


def symbolic_dimensions(layers: int, position_table: Optional[torch.Tensor], rows: Optional[int], beams: int = 1):
    """The inputs' symbolic dimensions: target capacity and source width, and the rows unless fixed (with
    ``beams`` > 1: the sentences, rows being ``beams`` times as many)."""
    from torch.export import Dim

    capacity, width = Dim("capacity", min=2), Dim("source", min=2)
    row = {0: Dim("rows", min=2)} if rows is None else {}  # the first dimension of every per-row input
    source = row  # the first dimension of the encoder-decoder inputs
    if beams > 1:
        sentences = Dim("sentences", min=1)
        row, source = {0: beams * sentences}, {0: sentences}
    table = {0: Dim("table_positions", min=2)} if position_table is not None else None
    keys = [{**row, 2: capacity}] * layers
    sources = [{**source, 2: width}] * layers
    return (row or None, row or None, {**row, 1: capacity}, table, keys, keys, sources, sources, {**source, 1: width},
            None)


def digest_of(parts: str, sources, module: nn.Module) -> str:
    """SHA-256 of what a compiled unit depends on: torch, ``parts`` (its settings), the engine's ``sources`` and
    the bytes of ``module``'s weights."""
    digest = hashlib.sha256(f"{torch.__version__} {parts}".encode())
    here = Path(__file__).parent
    for name in sources:
        digest.update((here / name).read_bytes())
    for name, tensor in module.state_dict().items():
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


class StepPackage:
    """A :class:`~fairseq_fastgen.engine.compiled_step.PaddedStep` (its beams and block) for ``rows`` rows (None:
    any number; with beams, any number of sentences), as a package to compile or load: its file, the exported
    program and inductor's settings."""

    def __init__(self, step: PaddedStep, position_table, rows: Optional[int] = None):
        self.step, self.position_table, self.rows = step, position_table, rows
        self.beams, self.block = step.beams, step.block
        self.threaded = threaded_loops(rows)

    @functools.cached_property  # its key hashes every weight: once
    def path(self) -> Path:
        what = f"beams{self.beams}" if self.beams > 1 else f"{'any' if self.rows is None else self.rows}-rows"
        if self.step.block_form:
            what = f"block{self.block}-{what}"
        return package_file(f"step-{what}-{self.key()}")

    def key(self) -> str:
        """The settings, the engine's code and the decoder step's weights (the decoder's parameters and the fused
        copies)."""
        return digest_of(repr((self.rows, self.threaded) + self.step.settings()), ENGINE_SOURCES,
                         self.step.decoder_step)

    def export(self):
        inputs = example_inputs(self.step, self.position_table, self.rows)
        dynamic = symbolic_dimensions(self.step.decoder_step.num_layers, self.position_table, self.rows, self.beams)
        return torch.export.export(self.step.eval(), inputs, dynamic_shapes=dynamic, strict=False)

    def settings(self) -> dict:
        """Frozen weights; for a fixed few rows of one position also inductor's C++ GEMM template for the products
        inductor computes (at 1-4 rows it beats both libraries' matrix-vector products, whose calls cost more; where
        the plugin's float32 kernel of a few rows serves, f32_rows_weights.py, it computes the linear layers). A block
        of positions keeps oneDNN's prepacked products, not autotuned: at 4 rows the template reads the weights at
        about half the rate of one row (a sweep of the base decoder's products: 17.8 ms against 8.7 at one row;
        oneDNN's 12.1), and autotuning, which times each product with its weights in cache, picked it anyway.
        Every unit's layer norms take Welford's mean and variance: inductor would take it for one row and a two-pass
        sum for a few, so a row's norm, and in int8 the integers of the next product's input, would depend on the
        rows beside it (blockwise's block unit against greedy's one-row unit: block_rows.py)."""
        settings = {"freezing": True, "cpp.use_two_step_variance_threshold": 0}
        if self.rows is not None and self.block == 1:
            settings.update(max_autotune=True, max_autotune_gemm_backends="CPP")
        if self.threaded:
            settings.update(THREADED_LOOPS)
        if self.shares_constants:
            settings["aot_inductor.package_constants_in_so"] = False
        return settings

    @property
    def shares_constants(self) -> bool:
        """Whether the unit reads its weights from the decode's own tensors (``bind_constants``) instead of a copy
        of its own: under --quantize int8, whose units read only named tensors (the int8 rows' buffers, the
        embeddings, the layer norms; no weight prepacked at compile time), every unit of a decoder reads the same
        ones (about 100 MB a unit at base size).  Under --quantize bf16 inductor packs each unit's bfloat16
        weights into its products' layout: constants of the unit."""
        reduced = self.step.decoder_step.reduced
        return reduced is not None and reduced.shares_constants

    def bind(self, loaded):
        """``loaded`` (the package's callable), reading the step's own tensors where it shares them."""
        return bind_constants(loaded, self.step) if self.shares_constants else loaded


# inductor writes the loops between the products (norms, softmaxes, the attention of a few positions) for as many
# threads as the compiling process runs, and a background compilation runs one: under torch's 2 threads such a unit
# ran them on one thread, the other waiting (beam 5, batch 64: 17% of the first thread's time in the unit's loops,
# the second idle 22% of its time). A unit of many rows for a process of more than one thread is written for this
# machine's cores, OpenMP's thread count read when it runs (torch's), and keyed apart from the one-thread unit (whose
# loops stay serial: no parallel regions to enter at one thread)
THREADED_LOOPS = {"cpp.threads": max(2, os.cpu_count() or 1), "cpp.dynamic_threads": True}


def threaded_loops(rows: Optional[int]) -> bool:
    """Whether a unit for ``rows`` rows (None: any number) made now gets THREADED_LOOPS: one of many rows, in a
    process running torch on more than one thread (read when the package is described, in the decoding process)."""
    return rows is None and torch.get_num_threads() > 1


class EncoderPackage:
    """An encoder's :class:`~fairseq_fastgen.engine.encoder_pass.EncoderPass` for one row or (``rows`` None) any
    number of rows, its source length symbolic, as a package to compile or load."""

    SOURCES = ("encoder_pass.py", "aot_step.py", "fused_weights.py", "layer_weights.py", "int8_weights.py")

    def __init__(self, encoder_pass: EncoderPass, rows: Optional[int] = None):
        self.encoder_pass, self.rows = encoder_pass, rows
        self.threaded = threaded_loops(rows)
        self.position_table = encoder_pass.position_table(2)

    @functools.cached_property  # its key hashes every weight: once
    def path(self) -> Path:
        return package_file(f"encoder-{'any' if self.rows is None else self.rows}-rows-{self.key()}")

    def key(self) -> str:
        return digest_of(repr((self.rows, self.threaded, type(self.encoder_pass.encoder).__qualname__)),
                         self.SOURCES, self.encoder_pass)

    def export(self):
        from torch.export import Dim

        weight = next(self.encoder_pass.parameters())
        rows = self.rows or 5
        tokens = torch.full((rows, 11), self.encoder_pass.encoder.padding_idx + 1, dtype=torch.long,
                            device=weight.device)
        row = {0: Dim("rows", min=2)} if self.rows is None else {}
        table = {0: Dim("table_positions", min=2)} if self.position_table is not None else None
        return torch.export.export(self.encoder_pass.eval(), (tokens, self.position_table,
                                                              self.encoder_pass.token_table()),
                                   dynamic_shapes=({**row, 1: Dim("source", min=2)}, table, None), strict=False)

    def settings(self) -> dict:
        return {"freezing": True, **(THREADED_LOOPS if self.threaded else {})}

    def bind(self, loaded):
        return loaded  # its constants in the package


def package_file(name: str) -> Path:
    directory = compiled_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{name}.pt2"


def load_or_compile(package):
    """``package`` (a :class:`StepPackage` or :class:`EncoderPackage`) loaded from disk, or compiled and written
    there; (callable, seconds, whether it was compiled now)."""
    start = time.perf_counter()
    path = package.path
    compiled_now = compile_once(package, path)
    return package.bind(load_package(path)), time.perf_counter() - start, compiled_now


def bind_constants(loaded, module: nn.Module):
    """``loaded``, a package compiled without its constants, made to read ``module``'s parameters and buffers of
    the same names in place (no copy).  ``loaded`` keeps them: the unit reads their memory as long as it lives."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    wanted = loaded.constant_names()
    missing = [name for name in wanted if name not in named]
    if missing:
        raise RuntimeError(f"the package reads {len(missing)} tensors the step does not hold, {missing[0]} first")
    loaded.keep_constants({name: named[name].detach().contiguous() for name in wanted})
    return loaded


def compile_once(package, path: Path) -> bool:
    """Compile ``package`` into ``path`` unless it is there; a process finding another compiling it waits for it
    (a file lock).  Returns whether this call compiled it."""
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return False
        compile_package(package, path)
        return True


def aot_compile_lock(exported, settings: dict) -> Path:
    """The lock a compilation of the program ``exported`` with inductor's ``settings`` holds in inductor's cache
    directory.  AOTInductor writes a graph's generated files (its metadata JSON among them) there under names of
    the code's hash, overwriting them in place: two processes compiling the same graph into different package paths
    (two test workers, two decodes with their own FASTGEN_COMPILED_DIR, units of other weights read in place) could
    otherwise package each other's half-written files.  The lock is named by the program as printed (its graph, its
    inputs' shapes and symbols; not its weights' values) and the settings: other graphs compile beside it."""
    program = hashlib.sha256(f"{exported}\n{sorted(settings.items())!r}".encode()).hexdigest()
    locks = inductor_cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"fairseq_fastgen-aot-{program[:32]}.lock"


class BackgroundCompilation:
    """A package compiled by a child process while the decode goes on: a fork of this process, which holds the
    model already, its output sent to /dev/null (a pipe reading the decode's output ends with the decode) and
    its priority lowered.  It outlives a decode that ends first, so that later runs load the package."""

    POLL_SECONDS = 0.5  # the child's state is looked at no more often than this

    def __init__(self, package, path: Path):
        self.package, self.path = package, path
        self.started = self.polled = time.perf_counter()
        self.pid = os.fork()
        if self.pid == 0:
            compile_in_child(package, path)  # never returns

    def ready(self):
        """None while the child compiles; then (the loaded step, seconds since the child started).  Raises
        RuntimeError where the child failed."""
        now = time.perf_counter()
        if now - self.polled < self.POLL_SECONDS:
            return None
        self.polled = now
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return None
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not self.path.exists():
            raise RuntimeError(f"the compiling process {self.pid} ended with status {code}")
        return self.package.bind(load_package(self.path)), time.perf_counter() - self.started


def compile_in_child(package, path: Path):
    """The forked child of :class:`BackgroundCompilation`: compile the package, then exit (status 0 only when it
    is on disk), without running anything of the parent's (no atexit handlers, no buffered output)."""
    status = 1
    try:
        quiet = os.open(os.devnull, os.O_RDWR)
        for descriptor in (0, 1, 2):
            os.dup2(quiet, descriptor)
        os.nice(10)
        torch.set_num_threads(1)
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # a compile worker pool of the parent's is not this process's
        compile_once(package, path)
        loader_class()  # the loader the parent will load the package with, built here if it is not yet (~30 s)
        status = 0
    finally:
        os._exit(status)


def compile_package(package, path: Path):
    """Export ``package``'s module and compile it into the package file ``path`` (AOTInductor), written under a
    temporary name and renamed."""
    exported = package.export()
    temporary = path.with_name(f".{path.stem}.{os.getpid()}{safe_files.TEMPORARY_SUFFIX}.pt2")
    import torch._inductor as inductor  # only where a package is compiled (loading needs none of it)

    # the autotuner's table of timed choices and inductor's own deprecation warnings stay out of the decode's output
    settings = dict(package.settings(), autotune_num_choices_displayed=0)
    with warnings.catch_warnings(), FileLock(str(aot_compile_lock(exported, settings))):
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        inductor.aoti_compile_and_package(exported, package_path=str(temporary), inductor_configs=settings)
    os.replace(temporary, path)
