import sys

from workloads.cli import main

# Guarded: allreduce starts its ranks with multiprocessing's "spawn", which imports this module
# again in every rank under another name.
if __name__ == "__main__":
    sys.exit(main())
