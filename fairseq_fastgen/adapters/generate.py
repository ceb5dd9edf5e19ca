"""What the plugin changes on a generator's ``generate``, and the attributes it gives a generator.

A wrapper is an instance attribute ``generate`` shadowing the class's method;
wrappers nest, the last one outermost.  :func:`unwrap_generate` removes them
all, :func:`take_back_attributes` what :func:`give_attributes` set.
"""

import functools

# what the plugin sets on a generator it built and reads back: the --decoder name, a stock generator's
# cluster projection and its statistics, the stand-ins of the linear layers (--onednn-linear, --quantize)
GIVEN_ATTRIBUTES = ("fastgen_decoder", "projection", "counters", "linear_forwards")


def wrap_generate(generator, wrapper):
    """From now on ``generator.generate(*args, **kwargs)`` is ``wrapper(generate, *args, **kwargs)``,
    ``generate`` being the one before."""
    generate = generator.generate

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        return wrapper(generate, *args, **kwargs)

    generator.generate = wrapped


def generate_within(generator, context, after=None):
    """From now on ``generator.generate`` runs inside ``context()`` (a new context manager per
    call); ``after``, when given, maps what it returns, outside the context."""

    def within(generate, *args, **kwargs):
        with context():
            result = generate(*args, **kwargs)
        return result if after is None else after(result)

    wrap_generate(generator, within)


def unwrap_generate(generator):
    """Undo every :func:`wrap_generate`: the class's ``generate`` again."""
    vars(generator).pop("generate", None)


def give_attributes(generator, **attributes):
    """Set attributes of :data:`GIVEN_ATTRIBUTES` on ``generator``."""
    unknown = set(attributes) - set(GIVEN_ATTRIBUTES)
    if unknown:
        raise ValueError(f"not an attribute the plugin gives a generator: {', '.join(sorted(unknown))}")
    for name, value in attributes.items():
        setattr(generator, name, value)


def take_back_attributes(generator):
    """Undo :func:`give_attributes` on a generator fairseq built (a plugin generator's ``counters`` are its own)."""
    for name in GIVEN_ATTRIBUTES:
        vars(generator).pop(name, None)
