"""The `sustain` command line: one module per group of commands."""
