"""Configuration: the settings model and its sources, and the exporter's web config."""
