"""The testing kit's own self-checks (testing/): the reference loops against their rules and against
independent implementations, and the tiny checkpoints they run on."""
