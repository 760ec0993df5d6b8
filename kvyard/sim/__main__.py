"""`python -m kvyard.sim …`: the same as `kvyard sim …` without loading the other commands (and torch)."""

from kvyard.sim.cli import main

raise SystemExit(main())
