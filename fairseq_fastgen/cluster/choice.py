"""Which projection a generator's options ask for: the cluster projection (``projection.py``), the screened one
(``screened.py``), the timed full projection, or none (the decoder's own)."""

from typing import Optional

from fairseq_fastgen.cluster.clusterfile import output_projection_of
from fairseq_fastgen.cluster.directory import Direction
from fairseq_fastgen.cluster.projection import TimedFullProjection, load_projection
from fairseq_fastgen.cluster.screened import screened_projection
from fairseq_fastgen.config import PluginOptions


def projection_requested(options: PluginOptions) -> bool:
    """Whether the generation options replace the decoder's projection (``--cluster-projection``,
    ``--screened-projection``, ``--time-projection``; ``--cluster-full-normalizer``, ``--cluster-union-normalizer``
    and ``--cluster-nearest`` too, so that without a file they are refused)."""
    return any((options.cluster_projection, options.time_projection, options.cluster_full_normalizer,
                options.cluster_union_normalizer, options.screened_projection, options.cluster_nearest != 1))


def projection_from_options(options: PluginOptions, temperature: Optional[float], model,
                            direction: Optional[Direction] = None, certified_top: int = 1
                            ) -> Optional[TimedFullProjection]:
    """The projection the generation options ask for: ``--cluster-projection FILE`` or ``DIR`` (checked
    against ``model`` and the run's ``direction``, its (source, target) languages or None), else
    ``--screened-projection``'s (float32's ``certified_top`` best tokens of each state), else
    ``--time-projection``'s timed full projection, else None (the decoder's own).  ``temperature``:
    fairseq's ``--temperature``, which ``--cluster-full-normalizer`` divides by too (the file's estimate of the
    mass outside its tokens serves at temperature 1 only)."""
    if not projection_requested(options):
        return None
    if options.cluster_nearest != 1 and not options.cluster_projection:
        raise ValueError(f"--cluster-nearest {options.cluster_nearest} chooses among the clusters of a file; "
                         "give it one with --cluster-projection FILE")
    if options.screened_projection:
        return screened_projection(model, certified_top, options)
    path = options.cluster_projection
    if options.cluster_full_normalizer and options.cluster_union_normalizer:
        raise ValueError("--cluster-full-normalizer and --cluster-union-normalizer are two ways to normalise: "
                         "give one of them")
    normalizer = "full" if options.cluster_full_normalizer else "union" if options.cluster_union_normalizer \
        else "estimate"
    if path:
        return load_projection(path, model, normalizer, direction, options.cluster_nearest, temperature or 1.0)
    if normalizer != "estimate":
        raise ValueError(f"--cluster-{normalizer}-normalizer changes how --cluster-projection normalises; "
                         "give it a cluster file with --cluster-projection FILE")
    output_projection_of(model.decoder)  # refuses decoders whose output_layer is not a plain projection
    return TimedFullProjection()
