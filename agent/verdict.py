"""The fewest iterations the steady-state analysis gives a verdict on, in one place for the
processes that must agree on it without importing one another.

The analysis (``agent.analysis``, numpy and scipy) classifies a shorter series as
``insufficient``; the probe runner in the daemon, which never imports the analysis, judges a run
that delivered fewer as out of time, and passes the number to the workload child
(``--min-iterations``), which sizes its problem so that this many iterations fit the duration.
This module imports nothing, so every room may import it.
"""

from __future__ import annotations

from typing import Final

MIN_ITERATIONS: Final = 30
