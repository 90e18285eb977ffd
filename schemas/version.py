"""Protocol version carried as `v` in every message."""

PROTOCOL_VERSION = 1
