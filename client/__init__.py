"""The client side of the fleet: submit a job over NATS and follow its events (`client.jobs`).

Needs only the wire protocol (`schemas`), so anything that talks to a fleet (the CLI, the web
viewer, evaluation, benches) uses it without importing the coordinator.
"""
