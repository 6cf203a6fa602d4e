"""NVIDIA GPUs through NVML, one module per concern: ``library`` (the choke point every NVML call
goes through), ``fields`` (the catalogue of exported families), ``xid`` (the XID event watcher)
and ``collector`` (the collector that ties them together). Import each name from its module."""
