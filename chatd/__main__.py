"""`python -m chatd` runs the `chatd` command."""

from chatd.cli import run

if __name__ == "__main__":  # not when a spawned process (--engine-process) imports this module
    run()
