"""``python -m fp4lab``: the command line."""

from fp4lab.cli import main

raise SystemExit(main())
