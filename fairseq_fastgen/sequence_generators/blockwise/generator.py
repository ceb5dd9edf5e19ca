"""The ``blockwise`` and ``blockwise-stream`` decoders: the policy (policy.py) in a generator, static
batches or streaming refills, and their counters."""

from fairseq_fastgen.option_checks import UsageError, require_int
from fairseq_fastgen.sequence_generators.blockwise.options import (
    BlockwiseOptions, build_acceptance, exact_acceptance, int8_proposals, proposal_tokens,
)
from fairseq_fastgen.sequence_generators.blockwise.policy import BlockwisePolicy
from fairseq_fastgen.counters import GenerationCounters
from fairseq_fastgen.sequence_generators.generator import FastgenGenerator, one_hypothesis_per_sentence
from fairseq_fastgen.registry import register_decoder
from fairseq_fastgen.sequence_generators.streaming import StreamingScheduler, StreamOptions, prepare_streaming_cli


class BlockwiseCounters(GenerationCounters):
    """Adds ``mean_accepted_block_size``: tokens per row and iteration."""

    def extra_stats(self):
        row_iterations = self.counts["row_iterations"]
        return {"mean_accepted_block_size": self.counts["tokens"] / row_iterations} if row_iterations else {}


@register_decoder(
    "blockwise", options=BlockwiseOptions,
    guarantee="blockwise parallel decoding of a transformer_khead model; exact acceptance (default) is "
              "token-identical to greedy decoding with head 1, --blockwise-top-k/-epsilon/-min-block approximate",
)
class BlockwiseGenerator(FastgenGenerator):
    """Blockwise parallel decoding with a k-head model (see policy.py)."""

    name = "blockwise"

    def new_counters(self):
        return BlockwiseCounters(self.name)

    @classmethod
    def build(cls, model, tgt_dict, gen_cfg, options, projection=None):
        one_hypothesis_per_sentence(cls.name, gen_cfg)
        blockwise = options.of(BlockwiseOptions)
        decoder = model.decoder
        if not hasattr(decoder, "forward_block"):
            raise ValueError(
                f"--decoder {cls.name} needs a k-head model (--arch transformer_khead); this checkpoint's decoder is "
                f"{type(decoder).__name__}"
            )
        block_size = blockwise.blockwise_block_size
        if block_size is None:  # default: every head (0 is refused, not read as this default)
            block_size = decoder.block_size
        if require_int("--blockwise-block-size", block_size, 1) > decoder.block_size:
            raise ValueError(
                f"--blockwise-block-size {block_size}: the model has {decoder.block_size} heads (--block-size of "
                f"transformer_khead); give 1 .. {decoder.block_size}"
            )
        min_block = blockwise.blockwise_min_block
        if require_int("--blockwise-min-block", min_block, 1) > block_size:  # more than a block: every token unverified
            raise ValueError(
                f"--blockwise-min-block {min_block}: at most the {block_size} tokens proposed per iteration "
                f"(--blockwise-block-size; the model has {decoder.block_size} heads); give 1 .. {block_size}"
            )
        acceptance = build_acceptance(blockwise, tgt_dict)
        # int8 proposals change no output where acceptance is exact: the default there, where the runner makes them
        int8 = int8_proposals(blockwise, exact_acceptance(acceptance, min_block))
        tokens = proposal_tokens(blockwise, tgt_dict, int8 is not None)
        policy = BlockwisePolicy(block_size, acceptance, min_block, tgt_dict.pad(), int8_proposals=int8 is not None,
                                 proposal_tokens=tokens)
        scheduler = cls.scheduler_for(options)
        policy.streaming = scheduler is not None  # finished rows wait for a refill's rows
        generator = cls(model, tgt_dict, gen_cfg, options.common, policy, scheduler, projection=projection)
        if policy.int8_proposals:
            try:  # made now: a model they cannot be made for is refused at the build (asked, or with a list)
                generator.runner.int8_proposals(policy.proposal_tokens)
            except ValueError:
                if int8 == "asked" or tokens is not None:
                    raise
                policy.int8_proposals = False  # the default where none are made (CUDA): full precision
        return generator

    @staticmethod
    def scheduler_for(options):
        return None  # static batches


@register_decoder(
    "blockwise-stream", prepare_cli=prepare_streaming_cli, reads=(BlockwiseOptions, StreamOptions),
    guarantee="blockwise decoding streamed with refills (continuous batching): rows at different lengths verify "
              "their blocks in one call; blockwise's tokens",
)
class BlockwiseStreamGenerator(BlockwiseGenerator):
    """Blockwise decoding with streaming refills: a refill's rows join the running ones (see streaming.py)."""

    name = "blockwise-stream"

    @staticmethod
    def scheduler_for(options):
        scheduler = StreamingScheduler.from_options(options.of(StreamOptions), joins_lengths=True)
        if scheduler.selection != "min-length":
            raise UsageError(f"--stream-selection {scheduler.selection}: --decoder blockwise-stream expands every "
                             f"active row at every iteration; the selection applies to the cohorts of greedy-stream, "
                             f"var-stream and fixed-stream")
        return scheduler
