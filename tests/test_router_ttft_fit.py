"""The speed the router fits for replicas that do not report their own (ttft_fit), and the running requests it
counts: its own streams, plus what a load report counts beyond the router's own requests of that moment."""

from __future__ import annotations

import random
import subprocess
import sys

from kvyard.api.load import LoadReport
from kvyard.router.policies import _running
from kvyard.router.replica import Replica
from kvyard.router.ttft_fit import MIN_SAMPLES, TtftFit


def test_the_fit_recovers_seconds_per_token_and_what_a_running_request_costs() -> None:
    rng = random.Random(0)
    fit = TtftFit()
    for _ in range(MIN_SAMPLES - 1):
        fit.observe(1000.0, 1, 0.5)
    assert fit.s_per_token == 0.0 and fit.running_cost is None  # too few samples: the fleet's figures are used
    fit = TtftFit()
    for _ in range(200):
        work, running = rng.uniform(100, 5000), rng.randrange(8)
        fit.observe(work, running, 0.02 + 1e-4 * work + 0.03 * running + rng.gauss(0, 0.002))
    assert abs(fit.s_per_token - 1e-4) < 5e-6
    assert fit.running_cost is not None and abs(fit.running_cost - 300) < 30


def test_a_few_stalls_the_plane_does_not_see_do_not_move_the_fit() -> None:
    """First-token times of seconds where the plane predicts a tenth (a replica paused by its core's neighbour)
    would make a running request weigh thousands of prefill tokens in a least-squares fit; they are left out."""
    rng = random.Random(1)
    fit = TtftFit()
    for number in range(240):
        work, running = rng.uniform(100, 5000), rng.randrange(8)
        seconds = 0.02 + 1e-4 * work + 0.03 * running + rng.gauss(0, 0.002)
        if number % 12 == 0:
            seconds += 8.0 + running  # 20 stalls, longer where more was running
        fit.observe(work, running, seconds)
    assert abs(fit.s_per_token - 1e-4) < 5e-6
    assert fit.running_cost is not None and abs(fit.running_cost - 300) < 30
    exact = TtftFit()  # on the plane to rounding: every sample kept
    for work in range(100, 3300, 100):
        exact.observe(float(work), work % 3, 0.05 + 2e-4 * work + 0.01 * (work % 3))
    assert abs(exact.s_per_token - 2e-4) < 1e-9 and exact.running_cost is not None
    assert abs(exact.running_cost - 50) < 1e-6


def test_without_spread_in_the_running_count_only_the_speed_is_fitted() -> None:
    fit = TtftFit()
    for work in range(100, 3300, 100):
        fit.observe(float(work), 2, 0.05 + 2e-4 * work)
    assert abs(fit.s_per_token - 2e-4) < 1e-6 and fit.running_cost == 0.0
    flat = TtftFit()
    for _ in range(32):
        flat.observe(500.0, 0, 0.1)  # the work never varied: time per unit of work, overhead included
    assert abs(flat.s_per_token - 0.1 / 500) < 1e-9


def test_running_requests_are_the_routers_streams_plus_other_clients_ones() -> None:
    replica = Replica("http://127.0.0.1:1")
    replica.load = LoadReport(num_running=5)
    replica.streaming_at_load, replica.awaiting_at_load = 3, 1  # the report counted 4 of the router's own
    replica.streaming = 1  # two of the router's streams ended since the report
    assert _running(replica) == 1 + (5 - 4)
    replica.load = LoadReport(num_running=2)  # fewer than the router's own at report time: none are others'
    assert _running(replica) == 1


def test_a_fit_loads_nothing_on_the_routers_event_loop() -> None:
    """np.median imports numpy.ma on its first call (26 ms here), which would stall every stream the router relays
    at its first fit; the fit's medians do without it (a fresh interpreter, as a router process starts)."""
    probe = (
        "import random, sys\n"
        "import kvyard.router.app\n"
        "from kvyard.router.ttft_fit import TtftFit\n"
        "fit = TtftFit()\n"
        "for _ in range(40):\n"
        "    fit.observe(random.uniform(100, 3000), random.randrange(4), random.uniform(0.05, 0.5))\n"
        "assert fit.s_per_token > 0\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"
