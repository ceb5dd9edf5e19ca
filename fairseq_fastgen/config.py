"""The plugin's generation options, merged into fairseq's ``GenerationConfig``.

fairseq reads every generation option from one dataclass (``GenerationConfig``)
and hands ``cfg.generation`` to ``task.build_generator``.  The plugin therefore
adds its options by subclassing that dataclass: :class:`PluginOptions` holds
the options every decoder shares, and each registered decoder contributes its
own options dataclass (see ``registry.py``).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.configs import GenerationConfig

from fairseq_fastgen.registry import DECODERS


@dataclass
class PluginOptions(FairseqDataclass):
    decoder: str = field(
        default="beam",
        metadata={"help": "decoding algorithm of fairseq_fastgen; 'beam' is stock fairseq beam search"},
    )
    step_engine: ChoiceEnum(["auto", "fairseq", "static", "compiled"]) = field(
        default="auto",
        metadata={"help": "what runs each decoder step: 'auto' (default: on the CPU in float32, int8 or bf16 "
                          "'compiled' with --compiled-freezing --compile-in-background: a first run on a new model "
                          "decodes at once, eager, while a child process compiles the steps and stores them on "
                          "disk; later runs load them; above the row buckets, on processors without AVX-512, "
                          "the static engine's step (--compiled-many-rows); on CUDA and in half precision 'static'; "
                          "$FASTGEN_STEP_ENGINE names another engine for 'auto'), "
                          "'static' (keys/values in preallocated "
                          "buffers, eager; bitwise fairseq's hypotheses), 'fairseq' (fairseq's own incremental "
                          "decoder) or 'compiled' (the same tokens, scores within 1e-4: at 1-2 rows the step "
                          "through torch.compile, shapes padded to a few buckets compiled on first use; on the CPU "
                          "more rows run one step for every row count, compiled ahead of time once per model and "
                          "kept on disk in $FASTGEN_COMPILED_DIR (default: inductor's cache directory); on "
                          "CUDA up to 512 rows in power-of-two buckets replayed as CUDA graphs; "
                          "--decoder beam runs fairseq's search on it); "
                          "a model the engine cannot serve (ensembles, other architectures) "
                          "falls back to 'fairseq' with one line saying why"},
    )
    compiled_freezing: bool = field(
        default=False,
        metadata={"help": "--step-engine compiled on the CPU (implied where auto runs compiled): freeze the "
                          "weights into the steps of 1, 2 and 4 rows "
                          "too (inductor's freezing, its C++ products), compiled ahead of time once per model and "
                          "kept on disk beside the step for more rows: faster steps at 1-4 rows, at the price of "
                          "a long compilation per row bucket the first time a model (or a change of its weights) "
                          "is decoded"},
    )
    compile_in_background: bool = field(
        default=False,
        metadata={"help": "--step-engine compiled on the CPU (implied where auto runs compiled): when a step "
                          "compiled ahead of time (the step for "
                          "many rows; with --compiled-freezing the row buckets' too) is not on disk yet, compile "
                          "it in a child process while the decode runs those steps eager (oneDNN's products), and "
                          "switch to it once it is ready; the child finishes and stores it even if the decode "
                          "ends first (later runs load it), so a first run on a new model or machine does not "
                          "wait for the compiler"},
    )
    compiled_many_rows: ChoiceEnum(["auto", "unit", "static", "kernel"]) = field(
        default="auto",
        metadata={"help": "--step-engine compiled on the CPU in float32 (and auto where it runs compiled): what "
                          "runs a one-position step of more rows than the row buckets (batches, beam search): "
                          "'unit' (one step for every row count, compiled ahead of time, oneDNN's prepacked "
                          "products), 'static' (the static engine's step, eager: torch's products, the "
                          "vocabulary's logits in aligned rows; no unit to compile for those rows), 'kernel' (that "
                          "step with the plugin's float32 kernel's products (AVX2 and FMA): another sum order than "
                          "torch's; the encoder runs eager through the kernel too, no unit compiled for it) or "
                          "'auto' (default: 'kernel' on processors without AVX-512, where it was measured fastest "
                          "at batch 64 and in beam search, else 'unit', measured faster there)"},
    )
    decoder_stats_json: Optional[str] = field(
        default=None,
        metadata={"help": "write the decoder's statistics (iterations, model calls, ...) as JSON to this file"},
    )
    cluster_projection: Optional[str] = field(
        default=None,
        metadata={"help": "cluster file from fastgen-train-clusters: project only onto the tokens of the "
                          "clusters nearest to the decoder states (every decoder); or its directory for a "
                          "multilingual model, from which the file of --source-lang-target-lang is taken, "
                          "else that of --target-lang"},
    )
    cluster_nearest: int = field(
        default=1,
        metadata={"help": "with --cluster-projection: each decoder state takes the active tokens of its N nearest "
                          "clusters (at most the file's clusters): more outputs the same as without the "
                          "projection, a wider projection"},
    )
    cluster_full_normalizer: bool = field(
        default=False,
        metadata={"help": "diagnostic for --cluster-projection: keep its candidate tokens but normalise their "
                          "probabilities over the whole vocabulary, as the full projection does (runs the full "
                          "projection too, so it is not faster); separates the effect of the missing tokens "
                          "from that of the softmax over the active tokens only"},
    )
    cluster_union_normalizer: bool = field(
        default=False,
        metadata={"help": "with --cluster-projection: normalise the probabilities over the active tokens only, "
                          "as files made before the estimate of the mass outside them do (by default a file that "
                          "holds that estimate adds it to the softmax's normaliser: more outputs the same as "
                          "without the projection, at beam search above all)"},
    )
    time_projection: bool = field(
        default=False,
        metadata={"help": "time the full vocabulary projection of every decoder step and report it with the "
                          "decoder's statistics (projection_*), as --cluster-projection reports its own; the "
                          "output is unchanged"},
    )
    screened_projection: bool = field(
        default=False,
        metadata={"help": "CPU: screen the vocabulary projection in int8 (a quarter of its float32 bytes) with a "
                          "proven error bound and recompute in float32 only the tokens that could be a state's "
                          "best: greedy and blockwise keep float32's tokens, beam search float32's candidates; "
                          "log-probabilities differ a little (the normaliser sums the other tokens' int8 "
                          "estimates); faster where the projection is a large share of a step (large "
                          "vocabularies, few rows); every decoder but with --no-repeat-ngram-size"},
    )
    onednn_linear: bool = field(
        default=False,
        metadata={"help": "CPU: compute the model's linear layers (vocabulary projection included) with oneDNN's "
                          "prepacked fp32 product instead of torch's default (MKL), faster on CPUs where MKL "
                          "takes a generic path, such as AMD's (slower on Intel Xeons, where MKL takes its fast "
                          "path: leave it off there); fp32 still, but summed in another order, so scores differ "
                          "in the last bits and a token can change where two candidates are that close (every "
                          "decoder)"},
    )
    quantize: Optional[ChoiceEnum(["int8", "bf16"])] = field(
        default=None,
        metadata={"help": "CPU: compute the model's linear layers (encoder, decoder, vocabulary projection) in "
                          "reduced precision, from the ordinary float32 checkpoint at first use: 'int8' (weights of "
                          "512 x 512 entries and more int8 per output row, smaller ones float32; inputs rounded "
                          "per row at each call: a row's result does not depend on the rows beside it, so every "
                          "exactness promise holds within int8), "
                          "'bf16' (bfloat16 products summed in float32, their outputs bfloat16, the vocabulary "
                          "projection float32; processors with AVX-512 BF16 or AMX); "
                          "attention, norms and softmaxes stay float32; scores and a few tokens differ from "
                          "float32's (docs/benchmarks.md, Precision); every decoder on --step-engine static "
                          "and fairseq; on compiled (and the default, auto) both run in its units: int8 rows they "
                          "read in place, bfloat16 weights packed into each unit"},
    )
    float32_vocabulary_projection: bool = field(
        default=False,
        metadata={"help": "with --quantize int8: keep the vocabulary projection in float32 (bf16 always does)"},
    )
    int8_library_kernels: bool = field(
        default=False,
        metadata={"help": "with --quantize int8: compute the int8 products through fbgemm's and oneDNN's kernels "
                          "instead of the plugin's own (built on first use for the processor: AVX-512 VNNI or AVX2, "
                          "kernels/int8_rows_cpu.cpp); the same bits, slower at a few rows: for comparison"},
    )
    reuse_large_allocations: bool = field(
        default=False,
        metadata={"help": "the default (see --no-reuse-large-allocations); accepted so that command lines that name "
                          "it keep running"},
    )
    no_reuse_large_allocations: bool = field(
        default=False,
        metadata={"help": "leave glibc's malloc settings as they are. By default, once a generator is built, the "
                          "process keeps buffers up to 1 GiB in its heap (glibc mallopt) instead of taking fresh "
                          "pages from the kernel for every buffer above 32 MiB, each of whose pages faults on first "
                          "touch: the (320, 32k) logits and log-probabilities of beam 5 at batch 64 over a 32k "
                          "vocabulary, a base model's cache reorders. The same outputs, about the same peak memory; "
                          "freed memory stays with the process for the rest of its life (every decoder)"},
    )
    no_inference_mode: bool = field(
        default=False,
        metadata={"help": "generate under torch.no_grad, as stock fairseq, instead of torch.inference_mode, "
                          "whose torch calls skip autograd's version counters and view tracking: the same "
                          "outputs, faster where a step makes many small calls (small batches, the CPU) "
                          "(every decoder)"},
    )
    postprocess_workers: int = field(
        default=0,
        metadata={"help": "fairseq-generate: detokenize, score and print in this many background workers "
                          "while the next batch decodes (0: in the main loop, as stock fairseq); fairseq-interactive "
                          "names it in a warning line and does not use it"},
    )
    no_shared_encoder_cache: bool = field(
        default=False,
        metadata={"help": "--decoder beam: keep one copy of the encoder-decoder attention keys/values per beam, "
                          "as stock fairseq does, instead of one per sentence shared by its beams; for language "
                          "models (transformer_lm), also decode and cache the prompt per beam",
                  "decoders": ("beam",)},  # the plugin's own decoders share them in their step engine's cache
    )
    no_lean_beam_loop: bool = field(
        default=False,
        metadata={"help": "--decoder beam: run fairseq's own beam search loop instead of the plugin's, which "
                          "gives the same output with fewer passes over the vocabulary per step",
                  "decoders": ("beam",)},
    )
    stop_at_top_eos: bool = field(
        default=False,
        metadata={"help": "--decoder beam: a sentence ends once its best candidate at a step has been "
                          "end-of-sentence and --nbest hypotheses have ended (CTranslate2's early exit), instead of "
                          "when --beam hypotheses have ended (stock fairseq's rule): fewer steps; the hypotheses "
                          "are the first ones stock's search ends, so with length-normalized scores (the default) "
                          "an output can differ from stock's (docs/benchmarks.md gives the share); with "
                          "--unnormalized the best hypothesis is stock's",
                  "decoders": ("beam",)},
    )


def build_generation_config():
    """Return a dataclass: fairseq's GenerationConfig plus every plugin option."""
    option_classes = [PluginOptions] + [e.options for e in DECODERS.values() if e.options is not None]
    merged = {}
    for cls in option_classes:
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):  # FairseqDataclass's private _name
                continue
            if f.name in merged:
                raise TypeError(f"generation option {f.name!r} is declared twice ({cls.__name__})")
            if f.name in GenerationConfig.__dataclass_fields__:
                raise TypeError(f"generation option {f.name!r} of {cls.__name__} shadows a fairseq option")
            merged[f.name] = (f.name, f.type, _copy_field(f))
    choices = ChoiceEnum(list(DECODERS))
    help_text = "decoding algorithm: " + "; ".join(
        f"{e.name}: {e.guarantee}" for e in DECODERS.values()
    )
    merged["decoder"] = ("decoder", choices, field(default="beam", metadata={"help": help_text}))
    return dataclasses.make_dataclass(
        "FastgenGenerationConfig", list(merged.values()), bases=(GenerationConfig,)
    )


def _copy_field(f):
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)
