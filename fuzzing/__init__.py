"""Hostile-input fuzzing: input generators (`inputs`) and the engines and targets behind `ddm-fleet fuzz`."""
