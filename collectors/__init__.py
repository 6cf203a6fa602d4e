"""Telemetry sources. Each module reads one source and returns typed samples in base units.

Collectors never raise into the agent for a field they cannot read: the field is absent from the
sample. A collector that cannot read anything raises ``CollectorError``; the sampler counts it and
reports the collector as down.
"""
