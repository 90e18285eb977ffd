"""Benchmarks that drive a fleet as its clients: `fleet` (bench fleet) and `worker` (bench worker)."""
