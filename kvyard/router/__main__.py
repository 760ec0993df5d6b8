"""`python -m kvyard.router …`: the same as `kvyard route …` without loading the other commands (and torch)."""

from kvyard.router.cli import main

raise SystemExit(main())
