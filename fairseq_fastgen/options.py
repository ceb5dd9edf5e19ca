"""The plugin's options, read once from ``cfg.generation`` into the dataclasses that declare them.

fairseq hands every generation option over in one config, ``cfg.generation``: an
omegaconf node (fairseq-generate, fairseq-interactive), a Namespace (the hub
interface), or a config stored in a checkpoint older than the plugin, which lacks
the plugin's fields.  :func:`parse_options` reads each plugin option from it once,
into :class:`~fairseq_fastgen.config.PluginOptions` (the options every decoder
shares) and into each registered decoder's options dataclass
(``registry.py``); a field the config lacks takes its declared
default.  The decoders' builders, the engine, the ops, the cluster projection and
the option checks take these typed values, never the raw config.
"""

import dataclasses
import enum
from typing import Any, Dict, List, Type, TypeVar

from fairseq_fastgen.config import PluginOptions
from fairseq_fastgen.option_checks import flag
from fairseq_fastgen.registry import DECODERS

Options = TypeVar("Options")


@dataclasses.dataclass(frozen=True)
class FastgenOptions:
    """Every plugin option of one generator, typed."""

    common: PluginOptions  # --decoder, --step-engine, ... (config.py)
    decoders: Dict[type, Any]  # each registered decoder-options dataclass -> its values (StreamOptions, ...)

    def of(self, options_class: Type[Options]) -> Options:
        """The values of one decoder-options dataclass, e.g. ``options.of(StreamOptions).stream_eps``."""
        return self.decoders[options_class]

    def by_name(self) -> Dict[str, Any]:
        """Every plugin option, by its field name (``var_beam_delta``: its value)."""
        values = {}
        for instance in [self.common, *self.decoders.values()]:
            values.update((f.name, getattr(instance, f.name)) for f in option_fields(type(instance)))
        return values


def parse_options(gen_cfg) -> FastgenOptions:
    """Read every plugin option from ``gen_cfg`` (an omegaconf node, a Namespace or a dataclass);
    fields it lacks take their declared defaults."""
    decoder_classes = dict.fromkeys(e.options for e in DECODERS.values() if e.options is not None)
    return FastgenOptions(
        common=read_options(PluginOptions, gen_cfg),
        decoders={options_class: read_options(options_class, gen_cfg) for options_class in decoder_classes},
    )


def read_options(options_class: Type[Options], gen_cfg) -> Options:
    """An ``options_class`` whose every field is read from ``gen_cfg``, or its default where ``gen_cfg``
    lacks it.  A choice option (fairseq's ``ChoiceEnum``) is read as its string."""
    values = {}
    for f in option_fields(options_class):
        value = getattr(gen_cfg, f.name, _MISSING)
        if value is _MISSING:
            value = _default(f)
        values[f.name] = value.value if isinstance(value, enum.Enum) else value
    return options_class(**values)


def options_not_read(entry, options: FastgenOptions) -> List[str]:
    """The options set away from their defaults that the decoder of registry ``entry`` does not read
    (``--stream-join-lengths`` with ``--decoder greedy``), as their command-line flags: of the decoder-options
    dataclasses, and the common options whose metadata names their decoders (``--no-lean-beam-loop``)."""
    flags = []
    for options_class, values in [(PluginOptions, options.common), *options.decoders.items()]:
        for f in option_fields(options_class):
            if options_class is PluginOptions and "decoders" not in f.metadata:
                continue  # read by every decoder
            if not entry.reads_option(options_class, f) and getattr(values, f.name) != _default(f):
                flags.append(flag(f.name))
    return flags


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def option_fields(options_class):
    """The option fields of a dataclass (FairseqDataclass's private ``_name`` is not an option)."""
    return [f for f in dataclasses.fields(options_class) if not f.name.startswith("_")]


_MISSING = object()
