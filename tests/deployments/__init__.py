"""The Ray Serve side: the applications on the session's cluster over HTTP and handles, the ingress and
its protocols, the engine server in process, the wire types, the router, the `blockserve` CLI's
argument building."""
