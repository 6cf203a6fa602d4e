"""A fake libnvidia-ml.so.1 for tests on machines without a GPU: see README.md."""
