"""ddm-fleet command line (entry point `ddm-fleet`)."""
