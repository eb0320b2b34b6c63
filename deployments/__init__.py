"""Ray Serve deployment of blockserve (HTTP API in docs/api.md, Ray usage in docs/deploy.md).

- `app`: `build_app(args)`, the application builder named in serve_config.yaml; `cli`: `blockserve serve`.
- `engine_server`: the EngineServer deployment (one per data-parallel replica) owning an AsyncEngine.
- `ingress`: the HTTP ingress (FastAPI via `@serve.ingress`) and the handle API; an ingress replica
  holds an engine client, the HTTP plumbing and one route group per protocol:
  - `sglang/`: SGLang's `/generate` (`protocol` request models, `serving` conversion and response
    builders, `routes` the route group); `openai/`: `/v1/completions`, `/v1/chat/completions`,
    `/v1/models`, likewise;
  - `rl/`: the RL control (`protocol` the one table of control operations and their payloads,
    `control` the cross-replica two-phase commit, `routes` their HTTP routes and handle methods);
    `admin`: /health, /metrics, OpenAPI;
  - `generation`: what the generation endpoints share; `engine_client`: calling the EngineServer
    replicas; `http`: error responses, API key, body limit, admission, SSE; `tokens`: the tokenizer.
- `errors`: ApiError and request validation; `wire`: the ingress <-> EngineServer protocol's types.
- `router`: the prefix-aware request router; `placement`: placement-group checks; `metrics`.
- `batch_calls`: ties batched unary calls to their clients (a client that leaves aborts its request);
  `single_machine`: loopback-only clusters, the HTTP port checks, the replicas' gRPC bind.
- `viewer/`: the denoising viewer page (`GET /viewer`, static files); `llm/`: Ray Serve LLM's
  `build_openai_app` / `LLMConfig` onto `build_app`, several models in one app.
"""
