"""`python -m gpumem`: the same as the `gpumem` command."""
from gpumem import _invocation

try:
    from gpumem.cli import main
except KeyboardInterrupt:  # Ctrl-C while it starts: see gpumem._invocation
    raise SystemExit(_invocation.EXIT_INTERRUPTED) from None

raise SystemExit(main())
