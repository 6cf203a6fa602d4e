"""Probe workloads (torch, device-agnostic). They run in a child process started by the probe
runner and are never imported by the daemon process."""
