"""Helpers outside the runtime that are not test scaffolding: `docs_walkthrough` runs every fenced
command of README and docs/ from a fresh clone, `published_checkpoints` writes reduced-depth random
checkpoints of published configurations. The tiny checkpoints and reference loops are the testing
kit's (testing/)."""
