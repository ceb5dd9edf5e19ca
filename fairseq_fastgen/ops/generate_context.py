"""One way for the plugin's per-generator options to change how ``generator.generate`` runs."""

import functools


def generate_within(generator, context, after=None):
    """From now on ``generator.generate`` runs inside ``context()`` (a new context manager per
    call); ``after``, when given, maps what it returns, outside the context."""
    generate = generator.generate

    @functools.wraps(generate)
    def generate_within_context(*args, **kwargs):
        with context():
            result = generate(*args, **kwargs)
        return result if after is None else after(result)

    generator.generate = generate_within_context
