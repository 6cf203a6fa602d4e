"""The software stack results are measured on, tracked over the agent's life."""
