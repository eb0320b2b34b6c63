"""What README.md, deployments/README.md and docs/ show, run as a reader runs it: the commands, the Python
blocks, the tiny-checkpoint one-liners, the first messages a new user reads."""
