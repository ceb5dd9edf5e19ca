"""``--reuse-large-allocations`` is applied when a generator is built (any decoder), and only
with the option.  What the setting does to malloc: tests/ops/test_heap.py."""

from fairseq.dataclass.configs import GenerationConfig

import fairseq_fastgen.ops.heap as heap


def test_generators_apply_the_option_when_built(loaded_toy, monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "reuse_large_allocations", lambda: calls.append("set") or True)
    for decoder, beam in (("beam", 2), ("greedy", 1)):
        loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(decoder=decoder, beam=beam))
    assert calls == []  # off by default
    for decoder, beam in (("beam", 2), ("greedy", 1)):
        loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(decoder=decoder, beam=beam,
                                                                            reuse_large_allocations=True))
    assert calls == ["set", "set"]
