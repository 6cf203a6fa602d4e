"""Probe runs: scheduling, running a child, the analysis hand-off and attribution."""
