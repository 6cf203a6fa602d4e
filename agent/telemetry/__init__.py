"""Live telemetry: the sampler loops, the in-memory store, the minute rollups."""
