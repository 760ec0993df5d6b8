"""The simulated replica's step clock: the cost model's schedule, kept through stalls shorter than catch_up_s."""

from __future__ import annotations

import pytest

from kvyard.sim.clock import StepClock


def test_steps_end_their_cost_after_the_previous_step() -> None:
    clock = StepClock(catch_up_s=0.05)
    assert clock.schedule(10.0, 0.01) == pytest.approx(10.01)
    assert clock.schedule(10.01, 0.02) == pytest.approx(10.03)
    assert clock.lag_s == 0.0
    assert clock.busy_s == pytest.approx(0.03)


def test_a_stall_shorter_than_catch_up_keeps_the_schedule() -> None:
    clock = StepClock(catch_up_s=0.05)
    clock.schedule(10.0, 0.01)
    # The process got to the next steps 30 ms late: they run back to back and end where the model says.
    assert clock.schedule(10.04, 0.01) == pytest.approx(10.02)
    assert clock.schedule(10.041, 0.01) == pytest.approx(10.03)
    assert clock.schedule(10.042, 0.01) == pytest.approx(10.04)
    assert clock.lag_s == 0.0


def test_a_longer_stall_restarts_from_the_present_and_counts_as_lag() -> None:
    clock = StepClock(catch_up_s=0.05)
    clock.schedule(10.0, 0.01)
    assert clock.schedule(10.11, 0.01) == pytest.approx(10.12)
    assert clock.lag_s == pytest.approx(0.1)


def test_no_catch_up_counts_every_late_start() -> None:
    clock = StepClock(catch_up_s=0.0)
    clock.schedule(10.0, 0.01)
    clock.schedule(10.015, 0.01)
    assert clock.lag_s == pytest.approx(0.005)


def test_restart_after_idle_starts_the_next_step_from_then() -> None:
    clock = StepClock(catch_up_s=0.05)
    clock.schedule(10.0, 0.01)
    clock.restart(20.0)
    assert clock.schedule(20.001, 0.01) == pytest.approx(20.01)
    assert clock.lag_s == 0.0


def test_the_first_step_is_not_late() -> None:
    clock = StepClock(catch_up_s=0.0)
    assert clock.schedule(1000.0, 0.01) == pytest.approx(1000.01)
    assert clock.lag_s == 0.0
