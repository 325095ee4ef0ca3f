"""``python -m swarmgrad``: the same as the ``swarmgrad`` command."""

from swarmgrad.cli import main

if __name__ == "__main__":  # not when multiprocessing re-imports the main module in a child
    main()
