"""The network fuzz targets: `worker`, `coordinator`, `websocket`, each `async fuzz(fleet, runs, seed,
concurrency, timeout, bar) -> FuzzResult` against the private `fuzzing.fleet.Fleet`."""
