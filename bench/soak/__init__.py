"""`python -m bench.soak`: an RL trainer's loop, repeated for hours against a blockserve deployment,
with the memory, file descriptors and threads of every process sampled as it goes.

Each iteration: a weight update (from disk, tensors by reference, or one flattened broadcast, in
turn), n-sample rollouts (unary and streamed), trajectory scoring of the rollouts, a pause drill
(abort, retract or in_place with an update inside it), a client that hangs up and an abort by rid;
optional faults (an engine replica or a TP worker killed, a client that drops mid-body). Every
request must end with a finish reason or an explicit error and carry the versions it ran under; the
run fails (exit status 1) on a memory leak after warm-up, a lost request or a version mismatch.
docs/rl.md tells how to run it; docs/benchmarks.md has the figures of a long run."""
