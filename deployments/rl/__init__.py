"""SGLang's RL control routes: payloads, the cross-replica two-phase commit, the route table."""
