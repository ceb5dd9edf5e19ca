"""Large-buffer reuse is applied when a generator is built (any decoder), by default, and not with
``--no-reuse-large-allocations``; both flags together are refused in one line.  What the setting does to
malloc: tests/ops/test_heap.py."""

import pytest
from fairseq.dataclass.configs import GenerationConfig

import fairseq_fastgen.ops.heap as heap
from fairseq_fastgen.option_checks import UsageError


def built_settings(loaded_toy, monkeypatch, **options):
    calls = []
    monkeypatch.setattr(heap, "reuse_large_allocations", lambda: calls.append("set") or True)
    for decoder, beam in (("beam", 2), ("greedy", 1)):
        loaded_toy.task.build_generator(loaded_toy.models, GenerationConfig(decoder=decoder, beam=beam, **options))
    return calls


def test_generators_reuse_large_allocations_by_default(loaded_toy, monkeypatch):
    assert built_settings(loaded_toy, monkeypatch) == ["set", "set"]
    assert built_settings(loaded_toy, monkeypatch, reuse_large_allocations=True) == ["set", "set"]


def test_the_opt_out_leaves_malloc_alone(loaded_toy, monkeypatch):
    assert built_settings(loaded_toy, monkeypatch, no_reuse_large_allocations=True) == []


def test_both_flags_are_refused(loaded_toy, monkeypatch):
    with pytest.raises(UsageError, match="--no-reuse-large-allocations: choose one"):
        built_settings(loaded_toy, monkeypatch, reuse_large_allocations=True, no_reuse_large_allocations=True)
