"""The kernels and attention backends of `ops`, each against its torch reference (a few end with whole
engine runs on the backend)."""
