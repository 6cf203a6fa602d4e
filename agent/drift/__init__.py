"""Lasting changes across probe results: the daemon's job and the detection child."""
