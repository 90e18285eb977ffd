"""Training: experts in isolation (torch / torch-xla / DDP in `train_torch`, JAX/Flax in `train_jax`)
and the router (`train_router`). Imports data, partitions and models; nothing of the serving path.
"""
