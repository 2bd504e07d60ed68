"""The `gpumem` console script's entry point, outside the gpumem package on purpose.

Importing gpumem imports torch, which takes a second or more. Starting here, before that import,
the command owns its whole start-up: a Ctrl-C during it exits 130 quietly, as at any later moment
(gpumem.cli.main), and the autoload hook, which runs inside torch's import, knows it is the command
by `running`, not by the script's file name (a user's own script named gpumem gets the hook).
"""
import sys

EXIT_INTERRUPTED = 130

running = False


def main() -> int:
    global running
    running = True
    try:
        from gpumem.cli import main as run_command
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return run_command()


if __name__ == "__main__":
    sys.exit(main())
