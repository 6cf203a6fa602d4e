import sys

from workloads.progress import Spinner

# Guarded: allreduce starts its ranks with multiprocessing's "spawn", which imports this module
# again in every rank under another name.
if __name__ == "__main__":
    # `list` for a person takes seconds (torch's import, then the device's checks): a spinner on
    # a terminal from before the import until the table is printed.
    table = sys.argv[1:2] == ["list"] and "--json" not in sys.argv[2:]
    spinner = Spinner("describing the workloads on this device")
    if table:
        spinner.start()
    try:
        from workloads.cli import main

        code = main(before_output=spinner.stop)
    finally:
        spinner.stop()
    sys.exit(code)
