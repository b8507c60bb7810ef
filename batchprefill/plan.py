"""`python -m batchprefill.plan`: the same as `batchprefill-plan` (cli/plan.py).

Run it, never import it: `import batchprefill.plan` would rebind `batchprefill.plan`, the Python API's function, to
this module (tests/test_api.py checks that nothing does).
"""

from batchprefill.cli.plan import main

if __name__ == "__main__":
    main()
