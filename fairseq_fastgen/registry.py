"""Registry of the decoders selectable with ``--decoder NAME``.

A decoder registers a builder and, optionally, a dataclass of its own options.
The integration module merges every registered options dataclass into fairseq's
``GenerationConfig`` so that the options show up in ``--help`` of
fairseq-generate / fairseq-interactive and arrive in ``cfg.generation``.

The builder is called as ``builder(models, tgt_dict, gen_cfg, options=options, **extra)``
where ``gen_cfg`` is ``cfg.generation`` (an omegaconf node, a Namespace from the
hub interface, or the merged dataclass) and ``options`` the plugin's options read
from it (``fairseq_fastgen/options.py``; a builder called without them reads them
itself), and returns an object with fairseq's generator interface:
``generate(models, sample, prefix_tokens=None, **kw)``.
A builder of ``None`` means "use fairseq's own ``build_generator``".
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Type


@dataclass(frozen=True)
class DecoderEntry:
    name: str
    builder: Optional[Callable]  # None: stock fairseq SequenceGenerator
    options: Optional[Type]  # dataclass of decoder-specific options, or None
    guarantee: str  # one line: what the decoder promises about its output
    # prepare_cli(cfg, tool) adjusts the full fairseq config before fairseq-generate
    # ("generate") or fairseq-interactive ("interactive") runs (e.g. streaming pools)
    prepare_cli: Optional[Callable] = None
    # the decoder-options dataclasses it reads (its own ``options`` too); a field may narrow this to the decoders
    # named in its metadata's "decoders"; an option it does not read, set on its command line, is named in a warning
    reads: Tuple[Type, ...] = ()

    def reads_option(self, options_class: Type, field) -> bool:
        """Whether this decoder reads ``field`` of ``options_class`` (a decoder-options dataclass, or the common
        options where the field's metadata names its decoders)."""
        readers = field.metadata.get("decoders")
        if readers is not None:
            return self.name in readers
        return options_class is self.options or options_class in self.reads


DECODERS: Dict[str, DecoderEntry] = {}


def register_decoder(name: str, options: Optional[Type] = None, guarantee: str = "", prepare_cli=None,
                     reads: Tuple[Type, ...] = ()):
    """Class decorator: ``@register_decoder("greedy", options=GreedyOptions)``; ``reads``: the other decoders'
    options dataclasses this one reads as well (``StreamOptions`` for a streamed decoder).

    The decorated class must provide ``from_config(models, tgt_dict, gen_cfg, options=None, **extra)``.
    """

    def wrap(cls):
        summary = guarantee or (cls.__doc__ or "").strip().split("\n")[0]
        register_builder(name, cls.from_config, options, summary, prepare_cli, reads)
        return cls

    return wrap


def register_builder(name, builder, options=None, guarantee="", prepare_cli=None, reads=()):
    if name in DECODERS:
        raise ValueError(f"decoder {name!r} is already registered")
    DECODERS[name] = DecoderEntry(name, builder, options, guarantee, prepare_cli, tuple(reads))


def decoder_names():
    return list(DECODERS)

