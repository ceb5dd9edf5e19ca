"""Layout plans (engine/row_plans.py) carried out by every runner: ``runner.carry_out(plan, encoder_out, cache)``
gives the encoder output and the cache that the runner's own operations gave when decoders called them in pairs
(fairseq's dict cache, the static engine's buffers, the compiled engine's buffers padded to its source buckets),
``merged_rows`` what ``concat_encoder_out`` and ``concat_caches`` gave, and a runner refuses, in one line, a plan
its cache cannot carry out.  Each side runs on its own cache, built the same way: the toy model's encoder output
of four sources of three widths and the first positions of their reference prefixes."""

import pytest
import torch

from fairseq_fastgen.engine import make_runner
from fairseq_fastgen.engine.compiled import CompiledRunner
from fairseq_fastgen.engine.fairseq_runner import ModelRunner
from fairseq_fastgen.engine.row_plans import KeepRows, NarrowSources, PlaceRows, ReleaseRows, WidenSources
from fairseq_fastgen.engine.static_cache import StaticCache
from tests.sequence_generators.test_runner import SENTENCES, STEPS, teacher_prefixes
from tests.sequence_generators.test_var_beam import toy  # noqa: F401  (fixture)

KEPT = torch.tensor([2, 0, 0, 3, 1])  # rows kept: reordered, one repeated
EXTRA = 14  # source positions a widening adds: 22 -> 36 (the static engine's keys), 32 -> 48 (the compiled's)
NARROW = 12  # source positions a narrowing keeps: 12 (the static engine's keys), 16 (the compiled's)
SLOTS, FRESH_ROWS = torch.tensor([3, 1]), torch.tensor([0, 2])  # a refill's rows 0 and 2 into rows 3 and 1
RELEASED = torch.tensor([0, 2])
PLANS = {  # src_len -> the plan
    "keep": lambda src_len: KeepRows(KEPT),
    "widen": lambda src_len: WidenSources(src_len, EXTRA),
    "narrow": lambda src_len: NarrowSources(NARROW),
    "release": lambda src_len: ReleaseRows(RELEASED),
}


def encoded(toy, ids=SENTENCES):
    with torch.no_grad():
        return ModelRunner(toy.models[0]).encode(toy.sample(ids)["net_input"])  # (src_len, rows, dim) states


def new_cache(toy, runner, encoder_out, ids=SENTENCES):
    """A cache of ``runner`` holding STEPS positions of the reference prefixes of ``ids``: written by the steps of
    fairseq's and the static engine; the compiled engine's started by its own ``start_cache`` and written as its
    padded step writes them (zeroed after them), so that no step is compiled.  Equal caches at every call."""
    prefixes = teacher_prefixes(toy, toy.sample(ids))  # (rows, 1 + STEPS)
    cache = runner.new_cache(prefixes.size(1))
    with torch.no_grad():
        if isinstance(runner, CompiledRunner):
            runner.start_cache(cache, encoder_out)
            cache.ensure_room(STEPS)
            generator = torch.Generator().manual_seed(0)
            for buffer in cache.self_keys + cache.self_values:  # (rows, heads, capacity, head_dim)
                buffer[:, :, :STEPS] = torch.randn(buffer[:, :, :STEPS].shape, generator=generator)
            cache.length = STEPS
            cache.zero_unwritten()
        else:
            for length in range(1, prefixes.size(1)):
                runner.step(prefixes[:, :length], encoder_out, cache)
    return cache


def by_operations(runner, name, encoder_out, cache, fresh):
    """What state.py and streaming.py called before plans: the runner's operations, in pairs."""
    if name == "keep":
        encoder_out = runner.reorder_encoder_out(encoder_out, KEPT)
        runner.reorder_cache(cache, KEPT)
    elif name == "widen":
        src_len = encoder_out["encoder_out"][0].size(0)
        encoder_out = runner.widened_sources(encoder_out, EXTRA)
        runner.widen_cache(cache, src_len, EXTRA)
    elif name == "narrow":
        encoder_out = runner.narrowed_sources(encoder_out, NARROW)
        runner.narrow_cache(cache, NARROW)
    elif name == "release":
        runner.release_rows(cache, RELEASED)
        runner.drop_leading_padding(cache)
    else:
        encoder_out = runner.placed_sources(encoder_out, SLOTS, fresh[0], FRESH_ROWS)
        runner.place_rows(cache, SLOTS, fresh[1], FRESH_ROWS)
    return encoder_out


def same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape \
            and torch.equal(got, want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


def contents(cache) -> dict:
    """Every field of a cache: a dict cache's buffers; a static cache's fields, its self-attention buffers at their
    written positions (the others are never read, and unset)."""
    if isinstance(cache, StaticCache):
        fields = dict(vars(cache))
        for name in ("self_keys", "self_values"):
            fields[name + " shapes"] = [buffer.shape for buffer in fields[name]]
            fields[name] = [buffer[:, :, : cache.length] for buffer in fields[name]]
        return fields
    return {f"{key} {name}": value for key, buffers in cache.items() for name, value in buffers.items()}


def assert_same(got_out, got_cache, want_out, want_cache):
    assert same(got_out, want_out)
    got, want = contents(got_cache), contents(want_cache)
    assert got.keys() == want.keys()
    assert [name for name in want if not same(got[name], want[name])] == []


def runner_of(toy, engine):
    return make_runner(engine, toy.models[0], 1.0, None)  # the compiled runner built, not compiled


@pytest.mark.parametrize("engine, name", [
    (engine, name) for engine in ("fairseq", "static", "compiled") for name in PLANS
    if engine != "fairseq" or name in ("keep", "widen")  # fairseq's cache takes no rows in place
] + [("static", "place"), ("compiled", "place")])
def test_a_plan_carried_out_is_the_runners_own_operations(toy, engine, name):
    runner = runner_of(toy, engine)
    encoder_out = encoded(toy)
    src_len, rows = encoder_out["encoder_out"][0].shape[:2]
    fresh = None
    if name == "place":  # a group of the same width whose rows 0 and 2 take the places of rows 3 and 1
        fresh_out = runner.reorder_encoder_out(encoder_out, torch.tensor([3, 2, 1, 0]))
        fresh = fresh_out, new_cache(toy, runner, fresh_out)
    plan = PlaceRows(SLOTS, *fresh, FRESH_ROWS) if name == "place" else PLANS[name](src_len)
    planned_cache, direct_cache = new_cache(toy, runner, encoder_out), new_cache(toy, runner, encoder_out)

    planned_out = runner.carry_out(plan, encoder_out, planned_cache)
    direct_out = by_operations(runner, name, encoder_out, direct_cache, fresh)

    assert_same(planned_out, planned_cache, direct_out, direct_cache)
    states = planned_out["encoder_out"][0]  # the plan did what it says
    expected = {"keep": (src_len, KEPT.numel()), "widen": (src_len + EXTRA, rows), "narrow": (NARROW, rows)}
    assert states.shape[:2] == expected.get(name, (src_len, rows))
    if name == "place":
        assert torch.equal(states[:, SLOTS], fresh[0]["encoder_out"][0][:, FRESH_ROWS])
    if engine != "fairseq" and name in ("widen", "narrow"):  # through each engine's own operations
        widths = {"static": {"widen": src_len + EXTRA, "narrow": NARROW}, "compiled": {"widen": 48, "narrow": 16}}
        assert planned_cache.cross_keys[0].size(2) == widths[engine][name]
    if name == "release":
        assert planned_cache.self_padding[:, :STEPS].tolist() == [[True] * STEPS, [False] * STEPS] * 2


@pytest.mark.parametrize("engine", ["fairseq", "static", "compiled"])
def test_merged_rows_are_the_runners_concatenations(toy, engine):
    """Two groups of sources 22 and 10 wide: ``merged_rows`` is ``concat_encoder_out`` and ``concat_caches``."""
    runner, groups = runner_of(toy, engine), ([0, 1], [2, 5])
    outs = [encoded(toy, ids) for ids in groups]
    planned = [new_cache(toy, runner, out, ids) for out, ids in zip(outs, groups)]
    direct = [new_cache(toy, runner, out, ids) for out, ids in zip(outs, groups)]

    merged_out, merged_cache = runner.merged_rows(outs, planned)

    assert_same(merged_out, merged_cache, runner.concat_encoder_out(outs), runner.concat_caches(direct))
    assert merged_out["encoder_out"][0].shape[:2] == (22, 4)


def test_fairseqs_runner_refuses_plans_its_cache_cannot_carry_out(toy):
    """fairseq's dict cache takes no rows in place: a plan that places or releases rows, or narrows the sources,
    is refused in one line naming it, the encoder output and cache untouched."""
    runner = runner_of(toy, "fairseq")
    encoder_out = encoded(toy)
    cache, untouched = new_cache(toy, runner, encoder_out), new_cache(toy, runner, encoder_out)
    for plan in (PlaceRows(SLOTS, encoder_out, runner.new_cache(), FRESH_ROWS), ReleaseRows(RELEASED),
                 NarrowSources(NARROW)):
        with pytest.raises(ValueError) as refused:
            runner.carry_out(plan, encoder_out, cache)
        message = str(refused.value)
        assert message.startswith(f"ModelRunner cannot carry out {type(plan).__name__}: its cache takes no rows")
        assert "\n" not in message
    assert_same(encoder_out, cache, encoded(toy), untouched)
    with pytest.raises(ValueError, match="not a plan of engine/row_plans.py"):
        runner.carry_out(KEPT, encoder_out, cache)
