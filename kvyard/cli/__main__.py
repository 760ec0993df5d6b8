"""`python -m kvyard.cli ...` is the `kvyard` command."""

from kvyard.cli import main

raise SystemExit(main())
