"""`python -m batchprefill.merge`: the same as `batchprefill-merge` (cli/merge.py)."""

from batchprefill.cli.merge import main

if __name__ == "__main__":
    main()
