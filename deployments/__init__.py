"""Ray Serve deployment of blockserve (HTTP API in docs/api.md, Ray usage in docs/deploy.md).

- `schemas`: HTTP/handle request models, conversion to GenerationConfig, response builders.
- `engine_server`: the EngineServer deployment (one per data-parallel replica) owning an AsyncEngine.
- `tp_executor`: the tensor-parallel executor (rank 0 in-process, ranks 1..tp-1 as Ray actors).
- `ingress`: the HTTP ingress (FastAPI via `@serve.ingress`) and the handle API.
- `app`: `build_app(args)`, the application builder named in serve_config.yaml.
"""
