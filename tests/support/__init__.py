"""What the tests share, as small modules: the fixture modules the root conftest.py loads through
`pytest_plugins` (checkpoints, the Serve cluster and its pool of applications, the hostile checkpoint,
engine helpers), and plain helpers a test imports (paths, ports, processes, HTTP, the suite's Ray
environment and worker groups, and the pieces several test modules of one subject share)."""
