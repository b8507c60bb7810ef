"""`python -m batchprefill.plan`: the same as `batchprefill-plan` (cli/plan.py)."""

from batchprefill.cli.plan import main

if __name__ == "__main__":
    main()
