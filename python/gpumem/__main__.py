"""`python -m gpumem`: the same as the `gpumem` command."""
from gpumem.cli import main

raise SystemExit(main())
