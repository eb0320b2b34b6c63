"""The repository as a whole: the import layers and contracts, README's test install, the suite's own
scheduler (support/worker_groups.py)."""
