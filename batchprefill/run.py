"""`python -m batchprefill.run`: the same as `batchprefill-run` (cli/run.py).

Run it, never import it: `import batchprefill.run` would rebind `batchprefill.run`, the Python API's function, to
this module (tests/test_api.py checks that nothing does).
"""

from batchprefill.cli.run import main

if __name__ == "__main__":
    main()
