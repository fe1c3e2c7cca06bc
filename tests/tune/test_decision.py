"""Whether a run replaces the incumbent (tvmflash/tune/decision.py), on synthetic timings: no kernel is
built or timed."""

import itertools

import pytest

from tvmflash.tune import decision
from tvmflash.tune.decision import decide


def test_a_gain_within_the_noise_keeps_the_incumbent():
    """The case of issue 43: an 8-trial CPU run found knobs 1.04x faster than the defaults, timed once
    each, and stored them. Timed five times each, the defaults' timings spread by 8%: the defaults stay."""
    times = {"default": [1.04, 1.00, 1.08, 1.05, 1.03], "#1": [1.00, 0.99, 1.01, 0.97, 1.02]}
    verdict = decide(times, "default", "#1")
    assert not verdict.replaced and verdict.kept == "default"
    assert verdict.speedup == pytest.approx(1.04 / 1.00) and verdict.noise == pytest.approx(0.08)
    assert verdict.reason == ("the tuned knobs #1 ran 1.040x as fast as the defaults (median of 5 timings each, "
                              "which spread by up to 8.0%): within the noise, the defaults stay")


def test_a_gain_beyond_the_noise_replaces_the_incumbent():
    times = {"user": [1.30, 1.28, 1.31], "#2": [1.00, 1.02, 1.01]}
    verdict = decide(times, "user", "#2")
    assert verdict.replaced and verdict.kept == "#2"
    assert verdict.speedup == pytest.approx(1.30 / 1.01) and verdict.noise == pytest.approx(0.03 / 1.28)
    assert verdict.reason.startswith("the tuned knobs #2 ran 1.287x as fast as your tuning record's knobs")
    assert verdict.reason.endswith("more than the noise, they replace them")


def test_the_noise_is_the_larger_spread_of_the_two():
    """The same medians pass or fail by either configuration's spread."""
    steady, noisy = [1.0, 1.0, 1.0], [0.9, 1.0, 1.1]
    assert decide({"default": [1.1] * 3, "#1": steady}, "default", "#1").replaced  # no noise: any gain
    assert not decide({"default": [1.1] * 3, "#1": noisy}, "default", "#1").replaced  # 1.1x within 22%
    assert not decide({"default": [1.0, 1.1, 1.2], "#1": steady}, "default", "#1").replaced  # 1.1x within 20%
    assert decide({"default": [1.3, 1.3, 1.3], "#1": noisy}, "default", "#1").replaced  # 1.3x beyond 22%


def test_an_incumbent_that_ran_fastest_or_failed():
    """The incumbent that is the fastest stays without a comparison; one that gives wrong results (or
    failed to build) is replaced whatever the times."""
    kept = decide({"default": [1.0]}, "default", "default")
    assert kept.kept == "default" and not kept.replaced and kept.reason == "the defaults ran fastest: they stay"
    failed = decide({"shipped": [0.5], "#1": [1.0]}, "shipped", "#1", incumbent_failed="give wrong results")
    assert failed.replaced and failed.speedup is None
    assert failed.reason == "the shipped record's knobs give wrong results: the tuned knobs #1 replace them"


def test_the_noise_needs_repeated_timings():
    with pytest.raises(ValueError, match="two timings or more of each, got 1 of #1"):
        decide({"default": [1.0, 1.1], "#1": [0.5]}, "default", "#1")


def test_the_incumbent_is_what_compile_takes_now():
    """compile() takes the user's record over the shipped one over the defaults."""
    assert decision.incumbent({"default": {}, "user": {}, "shipped": {}}) == "user"
    assert decision.incumbent({"default": {}, "shipped": {}}) == "shipped"
    assert decision.incumbent({"default": {}}) == "default"


def test_timings_are_taken_in_turns():
    """Each round times every configuration once, so a drift of the machine's speed falls on all."""
    order, clock = [], itertools.count(1)
    times = decision.timed_rounds({"a": lambda: "a", "b": lambda: "b"},
                                  lambda call: order.append(call()) or float(next(clock)), rounds=3)
    assert order == ["a", "b"] * 3
    assert times == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}
