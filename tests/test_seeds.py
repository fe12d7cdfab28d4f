"""support/seeds.py: every derived seed keeps the formula the published tables were made
with (a changed formula is another sample path for every run), and the streams of one
run do not meet."""

import random

import pytest

from support.seeds import derive_seed


def test_the_formulas_are_todays():
    assert derive_seed("step", 3, 5) == 3 * 1_000_003 + 5
    assert derive_seed("rank", 3_000_014, 1) == 3_000_014 + 2 ** 32
    assert [derive_seed("turn", 7, 2, k) for k in range(3)] == [7020, 7021, 7022]
    assert derive_seed("generator", 7) == 7999
    assert derive_seed("epoch", 2, 3) == 2 * 7919 + 3
    assert derive_seed("eval_batch", 1234, 48) == 1282
    assert derive_seed("paraphrase", 1234) == 1234 + 2 ** 31
    for seed, kind, epoch in ((0, "lookup", 0), (3, "two_step", 5)):  # what random.Random made of the string
        a, b = random.Random(f"{seed}/{kind}/{epoch}"), random.Random(derive_seed("kind_epoch", seed, kind, epoch))
        assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
    with pytest.raises(ValueError, match="no derived seed"):
        derive_seed("dropout", 0)


def test_a_rollouts_streams_stay_below_the_next_one():
    """The module seeds of every turn of a rollout seeded s lie in [1000 s, 1000 s + 999],
    so two rollouts (consecutive steps, or two ranks 2^32 apart) never share a stream."""
    for s in (derive_seed("step", 0, 0), derive_seed("step", 0, 1), derive_seed("rank", derive_seed("step", 0, 0), 1)):
        used = {derive_seed("turn", s, t, k) for t in range(1, 10) for k in range(3)} | {derive_seed("generator", s)}
        assert min(used) >= 1000 * s and max(used) <= 1000 * s + 999
