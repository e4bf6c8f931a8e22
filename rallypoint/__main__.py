"""`python -m rallypoint` is the `rallypoint` command."""

from rallypoint.cli import main

raise SystemExit(main())
