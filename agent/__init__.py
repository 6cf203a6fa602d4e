"""sustain: a node agent that measures what GPUs (or CPUs) sustain, and why it is less than peak."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sustain")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
