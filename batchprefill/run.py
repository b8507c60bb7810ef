"""`python -m batchprefill.run`: the same as `batchprefill-run` (cli/run.py)."""

from batchprefill.cli.run import main

if __name__ == "__main__":
    main()
