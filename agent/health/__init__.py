"""Each device's health: healthy, degraded or unhealthy, with every reason (docs/health.md)."""
