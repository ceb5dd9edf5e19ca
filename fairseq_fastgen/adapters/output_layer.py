"""A decoder's vocabulary projection through the cluster projection, for fairseq's own beam search.

The plugin's decoders call the projection from their runner; fairseq's
``SequenceGenerator`` (``--decoder beam``) calls ``decoder.forward``, so its
decoder's ``output_layer`` is routed through the projection: an instance
attribute :class:`ProjectedOutputLayer` shadowing the method, set only while
that generator's ``generate`` runs (other generators may share the model) and
removed by :func:`detach`.
"""

import contextlib
from typing import Optional

from torch import Tensor

from fairseq_fastgen.adapters.generate import generate_within, give_attributes
from fairseq_fastgen.cluster.clusterfile import output_projection_of
from fairseq_fastgen.cluster.directory import Direction
from fairseq_fastgen.cluster.choice import projection_from_options, projection_requested
from fairseq_fastgen.cluster.projection import ProjectionCounters, TimedFullProjection
from fairseq_fastgen.cluster.screened import certified_top
from fairseq_fastgen.config import PluginOptions


class ProjectedOutputLayer:
    """Stands in for ``decoder.output_layer`` (an instance attribute shadowing the method)."""

    def __init__(self, projection: TimedFullProjection, decoder):
        self.projection = projection
        self.decoder = decoder

    def __call__(self, features: Tensor) -> Tensor:
        return self.projection(features, self.decoder)


def attach(decoder, projection: TimedFullProjection):
    """Route ``decoder.forward``'s vocabulary projection through ``projection``."""
    output_projection_of(decoder)  # refuses decoders whose output_layer is not a plain projection
    decoder.output_layer = ProjectedOutputLayer(projection, decoder)


@contextlib.contextmanager
def attached(decoder, projection: TimedFullProjection):
    """``decoder.forward`` projects through ``projection`` inside the block only."""
    attach(decoder, projection)
    try:
        yield
    finally:
        detach(decoder)


def detach(decoder):
    """Undo :func:`attach`: the decoder's own ``output_layer`` again."""
    if isinstance(decoder.__dict__.get("output_layer"), ProjectedOutputLayer):
        del decoder.output_layer


def attached_projection(decoder) -> Optional[TimedFullProjection]:
    hook = decoder.__dict__.get("output_layer")
    return hook.projection if isinstance(hook, ProjectedOutputLayer) else None


def attach_to_stock_generator(generator, models, options: PluginOptions, temperature: Optional[float],
                              decoder_name="beam", direction: Optional[Direction] = None
                              ) -> Optional[TimedFullProjection]:
    """Make ``--cluster-projection`` (or ``--time-projection``) apply to fairseq's SequenceGenerator.

    With the option: loads the file and gives ``generator`` a ``projection`` and a
    ``counters`` attribute reporting its statistics; the projection is attached to the
    model's decoder only while ``generator.generate`` runs, so other generators built on
    the same model (a bench's other configurations, a hub interface's other settings)
    keep their own projection, or none. Without the option: nothing changes.
    """
    if not projection_requested(options):
        return None
    if len(models) != 1:
        raise ValueError(f"--cluster-projection and --screened-projection replace one model's projection; got an "
                         f"ensemble of {len(models)}")
    projection = projection_from_options(options, temperature, models[0], direction,
                                         certified_top(getattr(generator, "beam_size", 1)))
    decoder = models[0].decoder
    generate_within(generator, lambda: attached(decoder, projection))
    give_attributes(generator, projection=projection, counters=ProjectionCounters(decoder_name, projection.statistics))
    return projection
