"""The test suite, laid out like what it tests (docs/architecture.md, "The testing kit and the tests"):
`ops/`, `engine/` (`engine/families/`: each model family against its reference), `deployments/`,
`system/`, `bench/`, `docs/`, `testing/` (the testing kit's own self-checks), `project/` (the repository
as a whole), and `support/`, the helpers and fixtures they share."""
