"""Whether a tuning run's fastest configuration replaces the incumbent: the knobs ``tvmflash.compile``
takes now (the user's record, else the shipped one, else the defaults).

The rule: the challenger (the run's fastest correct configuration) replaces the incumbent only when
it beats it by more than the noise of repeated timings, both timed in the same run, in turns
(``timed_rounds``): its median time must be below the incumbent's by a factor of more than 1 + the
larger relative spread, (max - min) / min, of the two configurations' timings (``spread``). Timed
once each, an 8-trial run on the CPU stored a "1.04x" record within that noise, which then changed
``tvmflash.compile``'s knobs. A run that does not beat the incumbent keeps it: the record holds the
incumbent's knobs (so ``compile`` says the tuning found none faster), and the reason is printed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

# Timings of each configuration compared: enough for their spread to show the machine's noise.
ROUNDS = 5
# The known configurations (``run.known_configurations``) in the order compile() prefers them.
PREFERENCE = ("user", "shipped", "default")


def timed_rounds(calls: dict[str, Callable[[], object]], time_ms: Callable[[Callable], float],
                 rounds: int = ROUNDS) -> dict[str, list[float]]:
    """label -> ms of each round: ``time_ms(call)`` (itself a median of several calls) of every
    configuration once a round, in turn, so that a drift of the machine's speed (clocks, another
    process) falls on all of them alike."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            times[label].append(time_ms(call))
    return times


def spread(samples: list[float]) -> float:
    """How far apart repeated timings of one configuration fall, relative to the fastest:
    (max - min) / min."""
    return (max(samples) - min(samples)) / min(samples)


def incumbent(known: dict) -> str:
    """The label of the known configuration (label -> knobs) that compile() takes now: the user's
    record, else the shipped one, else the defaults."""
    return next(label for label in PREFERENCE if label in known)


def describe(label: str) -> str:
    """A configuration's label as the tuner's messages name it."""
    return {"default": "the defaults", "user": "your tuning record's knobs",
            "shipped": "the shipped record's knobs"}.get(label, f"the tuned knobs {label}")


@dataclass(frozen=True)
class Decision:
    """What a run keeps: ``kept``, the incumbent's label or the challenger's, and why (``reason``).
    ``speedup``: the incumbent's median time over the challenger's; ``noise``: the larger spread of
    their timings (both None where they were not compared)."""

    kept: str
    incumbent: str
    challenger: str
    reason: str
    speedup: float | None = None
    noise: float | None = None

    @property
    def replaced(self) -> bool:
        """Whether the challenger replaces the incumbent (compile() takes new knobs)."""
        return self.kept != self.incumbent

    def record_fields(self) -> dict:
        """What a tuning record keeps of the decision that made it."""
        return {"incumbent": self.incumbent, "kept": self.kept, "decision": self.reason,
                **({"noise": round(self.noise, 4)} if self.noise is not None else {})}


def decide(times: dict[str, list[float]], incumbent: str, challenger: str,
           incumbent_failed: str | None = None) -> Decision:
    """Keep the incumbent, or replace it by the challenger (labels of ``times``: label -> ms of
    repeated timings, at least two each where both ran): the challenger must run faster than the
    incumbent by more than the noise, the larger ``spread`` of their timings. ``incumbent_failed``:
    why the incumbent cannot stay (wrong results at the tuning shape, a failed build), whatever the
    times."""
    if challenger == incumbent:
        return Decision(incumbent, incumbent, challenger,
                        f"{describe(incumbent)} ran fastest: they stay")
    if incumbent_failed is not None:
        return Decision(challenger, incumbent, challenger,
                        f"{describe(incumbent)} {incumbent_failed}: {describe(challenger)} replace them")
    few = [label for label in (incumbent, challenger) if len(times[label]) < 2]
    if few:
        raise ValueError(f"times: the noise needs two timings or more of each, got {len(times[few[0]])} of {few[0]}")
    speedup = statistics.median(times[incumbent]) / statistics.median(times[challenger])
    noise = max(spread(times[incumbent]), spread(times[challenger]))
    rounds = min(len(times[incumbent]), len(times[challenger]))
    compared = (f"{describe(challenger)} ran {speedup:.3f}x as fast as {describe(incumbent)} (median of {rounds} "
                f"timings each, which spread by up to {noise:.1%})")
    if speedup > 1 + noise:
        return Decision(challenger, incumbent, challenger, f"{compared}: more than the noise, they replace them",
                        speedup, noise)
    return Decision(incumbent, incumbent, challenger, f"{compared}: within the noise, {describe(incumbent)} stay",
                    speedup, noise)
