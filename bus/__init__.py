"""Bus plumbing every process uses: server URLs, the embedded nats-server for tests and the local fleet.

The lowest layer beside ``schemas/``: it imports nothing of the project.
"""
