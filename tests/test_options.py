"""The plugin's options are read once from ``cfg.generation`` into their typed dataclasses."""

import dataclasses
from argparse import Namespace

from fairseq.dataclass.configs import GenerationConfig  # the plugin's merged class
from omegaconf import OmegaConf

import fairseq_fastgen  # noqa: F401  (registers the decoders and their options)
from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.options import FastgenOptions, options_not_read, parse_options, read_options
from fairseq_fastgen.sequence_generators.blockwise.options import BlockwiseOptions
from fairseq_fastgen.registry import DECODERS
from fairseq_fastgen.sequence_generators.streaming import StreamOptions
from fairseq_fastgen.sequence_generators.var_beam import VarBeamOptions


def test_a_namespace_without_the_plugins_fields_gets_every_default():
    """A hub interface's Namespace, or a config stored before the plugin existed."""
    options = parse_options(Namespace(beam=5, lenpen=1.0))
    assert options.common == PluginOptions()
    assert options.of(StreamOptions) == StreamOptions()
    assert options.of(VarBeamOptions) == VarBeamOptions()
    assert options.of(BlockwiseOptions) == BlockwiseOptions()


def test_every_registered_options_class_is_read():
    options = parse_options(Namespace())
    registered = {entry.options for entry in DECODERS.values() if entry.options is not None}
    assert set(options.decoders) == registered
    assert all(type(options.of(cls)) is cls for cls in registered)


def test_values_set_in_a_namespace_are_read():
    options = parse_options(Namespace(var_beam_delta=0.5, stream_capacity=8, step_engine="fairseq",
                                      onednn_linear=True, blockwise_top_k=3))
    assert options.of(VarBeamOptions).var_beam_delta == 0.5
    assert options.of(VarBeamOptions).var_beam_max_cands == VarBeamOptions.var_beam_max_cands  # the default
    assert options.of(StreamOptions).stream_capacity == 8
    assert options.of(BlockwiseOptions).blockwise_top_k == 3
    assert options.common.step_engine == "fairseq"
    assert options.common.onednn_linear is True
    assert options.common.decoder == "beam"


def test_an_omegaconf_node_is_read_with_its_choices_as_strings():
    node = OmegaConf.structured(GenerationConfig(decoder="var-stream", step_engine="compiled", beam=3,
                                                 stream_selection="fifo", stream_eps=0.25,
                                                 decoder_stats_json="stats.json"))
    options = parse_options(node)
    assert options.common.decoder == "var-stream" and type(options.common.decoder) is str
    assert options.common.step_engine == "compiled" and type(options.common.step_engine) is str
    assert options.common.decoder_stats_json == "stats.json"
    assert options.of(StreamOptions).stream_selection == "fifo"
    assert type(options.of(StreamOptions).stream_selection) is str
    assert options.of(StreamOptions).stream_eps == 0.25


def test_a_stored_omegaconf_node_without_the_plugins_fields_gets_the_defaults():
    """A checkpoint's config from before the plugin: a struct node refuses unknown keys."""
    node = OmegaConf.create({"beam": 4, "var_beam_delta": 2.0})
    OmegaConf.set_struct(node, True)
    options = parse_options(node)
    assert options.common == PluginOptions()
    assert options.of(VarBeamOptions) == VarBeamOptions(var_beam_delta=2.0)


def test_by_name_lists_every_plugin_option_once():
    options = parse_options(Namespace(stream_pool=7))
    by_name = options.by_name()
    declared = [f.name for cls in [PluginOptions, *options.decoders]
                for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    assert sorted(by_name) == sorted(declared)
    assert by_name["stream_pool"] == 7
    assert by_name["decoder"] == "beam"


def test_read_options_takes_one_dataclass():
    assert read_options(VarBeamOptions, Namespace(var_beam_max_cands=2)) == VarBeamOptions(var_beam_max_cands=2)
    assert isinstance(parse_options(Namespace()), FastgenOptions)


def test_options_not_read_are_those_of_other_decoders():
    """Each decoder reads its own options and the streaming ones where it streams; --stream-join-lengths and
    --stream-cohorts are greedy-stream's alone.  Options left at their defaults are never named."""
    given = Namespace(stream_eps=0.5, stream_join_lengths=True, stream_cohorts=True, blockwise_top_k=3,
                      var_beam_delta=0.5, no_lean_beam_loop=True, onednn_linear=True)  # --onednn-linear: every one's
    not_read = {name: set(options_not_read(entry, parse_options(given))) for name, entry in DECODERS.items()}
    stream, top_k, delta = "--stream-eps", "--blockwise-top-k", "--var-beam-delta"
    forms = {"--stream-join-lengths", "--stream-cohorts"}  # greedy-stream's
    lean = "--no-lean-beam-loop"  # stock beam search's
    assert not_read == {
        "beam": {stream, top_k, delta} | forms,
        "greedy": {stream, top_k, delta, lean} | forms,
        "greedy-stream": {top_k, delta, lean},
        "blockwise": {stream, delta, lean} | forms,
        "blockwise-stream": {delta, lean} | forms,
        "var-batch": {stream, top_k, lean} | forms,
        "var-stream": {top_k, lean} | forms,
        "fixed-stream": {top_k, delta, lean} | forms,
    }
    assert all(options_not_read(entry, parse_options(Namespace())) == [] for entry in DECODERS.values())
