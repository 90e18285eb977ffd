"""Training data: the offline MNIST loader (`mnist`) and the expert partitions (`partition`).

Below both training and serving: the coordinator's oracle strategy reads a partition manifest.
"""
