"""Generation quality: judges, FID, FLOPs, and the DDM-vs-monolith table behind `ddm-fleet eval`."""
