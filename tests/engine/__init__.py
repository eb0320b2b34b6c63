"""The engine's machinery, in process and without Ray unless a test says so: checkpoint loading, the
scheduler and KV pages, sampling and stopping, decoding rules and typed decisions, the front-ends
(pipeline, AsyncEngine, the adapters, `engine.trace`), weight updates and memory release."""
