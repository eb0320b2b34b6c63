"""SGLang's routes (the ingress's route group `SGLangRoutes`): `/generate` with the handle methods
`generate` / `generate_stream` (exactly the HTTP JSON, unary, and the SSE chunks, streamed),
`/server_info`, `/model_info`, `/health_generate` and `/abort_request` (with the handle methods
`server_info` and `abort_request`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.engine_client import EngineClient
from deployments.errors import ApiError, parse
from deployments.http import ENGINE_ERRORS, HttpServing, Route, generation_route, json_roundtrip, sse_response
from deployments.sglang.protocol import AbortRequest, GenerateRequest, NativeGenerateRequest, is_native
from deployments.sglang.serving import CumulativeStream, generate_body, generate_plan
from deployments.tokens import TokenText
from deployments.vllm_names import vllm_body
from deployments.wire import ControlAnswer


def _indexed(body: dict[str, Any], index: int, as_list: bool) -> dict[str, Any]:
    """A /generate body as an entry of a list answer (a batch or n > 1) carries its `index`."""
    return body | {"index": index} if as_list else body


def _vllm_level(body: Any) -> str | None:
    """Where a /generate body takes vLLM's typed-read fields: SGLang's native body in `sampling_params`,
    the flat one at its top (None)."""
    return "sampling_params" if isinstance(body, dict) and is_native(body) else None


def _streamed(body: Any, stream: bool) -> Any:
    """A handle's body with `stream` set by the method called (a non-object is refused later)."""
    return body | {"stream": stream} if isinstance(body, dict) else body


class SGLangRoutes:
    """SGLang's API for the served model (`served_model_name`; `token_text`: its tokens' texts), from an
    ingress of API `version`; `incremental_streaming_output` and `enable_memory_saver`: SGLang's
    server flags (see deployments.app)."""

    ROUTES = (
        generation_route("/generate", "http_generate", "Generate (SGLang-style: the flat body or SGLang's native "
                         "one; SSE when stream)", GenerateRequest, NativeGenerateRequest),
        *(Route(path, "http_server_info", ("GET",), dict(responses=ENGINE_ERRORS,
                                                          summary="SGLang's server info (parallelism, limits)"))
          for path in ("/server_info", "/get_server_info")),
        *(Route(path, "http_model_info", ("GET",), dict(responses=ENGINE_ERRORS,
                                                         summary="SGLang's model info (with weight_version)"))
          for path in ("/model_info", "/get_model_info")),
        Route("/health_generate", "http_health_generate", ("GET",), dict(
            response_class=Response, responses={200: {"description": "the engine generated a token (no body)"}}
            | ENGINE_ERRORS, summary="200 once the engine generates a token, else 503")),
        # it ends other clients' requests: out of /openapi.json, like the RL control routes
        Route("/abort_request", "http_abort_request", options=dict(
            include_in_schema=False, summary="Abort a request by rid, or all (abort_all)")),
    )
    HANDLES = ("generate", "generate_stream", "server_info", "abort_request")

    def __init__(self, client: EngineClient, http: HttpServing, served_model_name: str, version: str,
                 token_text: TokenText, incremental_streaming_output: bool, enable_memory_saver: bool):
        self.client = client
        self.http = http
        self.served_model_name = served_model_name
        self.version = version
        self.token_text = token_text
        self.incremental_streaming_output = incremental_streaming_output
        self.enable_memory_saver = enable_memory_saver

    async def http_generate(self, request: Request) -> Response:
        query_model = request.query_params.get("model")
        return await self.http.serve(request, "/generate", lambda body: self._generate_route(body, query_model),
                                     limited=True)

    async def _generate_route(self, body: Any, query_model: str | None) -> Response:
        stream, answer = await self._generate(body, query_model)
        return sse_response(answer) if stream else JSONResponse(answer)

    async def _generate(self, body: Any, query_model: str | None = None) -> tuple[bool, Any]:
        """Any /generate body (flat or SGLang-native): (streamed?, the answer JSON or an iterator of
        chunk bodies). A batch or n > 1 answers a list in order, each entry with its `index`; streamed,
        the chunks of all of them interleave, each with its `index`. Chunks are cumulative (SGLang's
        default) or deltas (`incremental_streaming_output`). A body or `query_model` (`?model=`) naming
        another model than this one is answered by this one, and `meta_info` says so (`model_note`).
        vLLM's typed-read fields are taken in the flat body and in `sampling_params` (`deployments.vllm_names`)."""
        body, names = vllm_body(body, _vllm_level(body))
        with names.errors():
            plan = generate_plan(body, self.served_model_name, query_model)
            reqs = [r for group in plan.groups for r in group]
            params = [r.params for r in reqs]
            token_text = self.token_text if plan.text_in_logprobs else None
            if not plan.stream:
                outs = await self.client.unaries(reqs)
                bodies = [_indexed(generate_body(o, p, token_text, plan.meta), i, plan.as_list)
                          for i, (o, p) in enumerate(zip(outs, params))]
                return False, bodies if plan.as_list else bodies[0]
            merged = await self.client.streams(reqs)
        cumulative = None if self.incremental_streaming_output else [CumulativeStream() for _ in reqs]

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            try:
                async for i, out in merged:
                    chunk = generate_body(out, params[i], token_text, plan.meta)
                    if cumulative is not None:
                        chunk = cumulative[i].chunk(chunk)
                    yield _indexed(chunk, i, plan.as_list)
            finally:
                await merged.aclose()

        return True, chunks()

    # ---- SGLang's server routes --------------------------------------------------------------
    async def http_server_info(self, request: Request) -> Response:
        async def info() -> Response:
            return JSONResponse(await self.server_info())

        return await self.http.serve(request, request.url.path, info, body=False)

    async def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info`: its server-args names for what this deployment has. `dp_size` is
        the number of engine replicas and `tp_size` each one's, so a trainer's broadcast group for
        this URL has 1 + dp_size * tp_size ranks. The fields slime's engine discovery and server-args
        check read are all here, at SGLang's values for a plain (not disaggregated) server."""
        info = await self.client.info()
        replicas = await self.client.replica_stats()
        engine = info.engine
        facts = {"model_type": info.model_type, "is_dllm": info.is_dllm, "dllm_paradigm": info.paradigm,
                 "engine": engine.model_dump(mode="json")}
        return {
            "model_path": info.model_path, "tokenizer_path": info.model_path,
            "served_model_name": self.served_model_name, "is_generation": True,
            "tp_size": info.tp, "dp_size": len(replicas), "pp_size": 1, "ep_size": 1, "moe_dp_size": 1,
            "disaggregation_mode": "null", "encoder_only": False, "enable_memory_saver": self.enable_memory_saver,
            "context_length": info.max_model_len, "max_total_num_tokens": info.max_total_num_tokens,
            "max_running_requests": engine.max_batch_size, "chunked_prefill_size": engine.max_prefill_token_num,
            "page_size": engine.kv_block_size, "disable_radix_cache": not engine.enable_prefix_caching,
            "skip_tokenizer_init": False, "incremental_streaming_output": self.incremental_streaming_output,
            "weight_version": await self.client.weight_version(), "version": self.version,
            # one per engine replica: the model facts, and how its forwards run (attention backend, CUDA
            # graphs on with their counts, or off and why -- a capture that failed says so here)
            "internal_states": [{**facts, **s.engine.load.executor.forwards()} for s in replicas] or [facts],
        }

    async def http_model_info(self, request: Request) -> Response:
        async def info() -> Response:
            engine = await self.client.info()
            return JSONResponse({
                "model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": await self.client.weight_version(),
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": engine.model_type, "architectures": engine.architectures})

        return await self.http.serve(request, request.url.path, info, body=False)

    async def http_health_generate(self, request: Request) -> Response:
        async def health() -> Response:
            plan = generate_plan({"input_ids": [0], "max_tokens": 1, "temperature": 0})
            await self.client.unaries([r for group in plan.groups for r in group])
            return Response(status_code=200)

        return await self.http.serve(request, "/health_generate", health, body=False)

    async def http_abort_request(self, request: Request) -> Response:
        async def abort(body: Any) -> Response:
            return JSONResponse(await self.abort_request(body))

        return await self.http.serve(request, "/abort_request", abort)

    async def abort_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """`{"rid"}` or `{"abort_all": true}` on every engine replica: the requests end with
        finish_reason "abort" and what they generated so far."""
        req = parse(AbortRequest, body)
        answers = await self.client.broadcast("abort_request", req.rid, req.abort_all, return_exceptions=True)
        aborted = sum(a.requests or 0 for a in answers if isinstance(a, ControlAnswer))
        return {"success": True, "message": f"aborted {aborted} requests", "requests": aborted}

    # ---- handle API (other Ray jobs) -------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Same JSON as the HTTP unary /generate (a list for a batch or n > 1; the error JSON for
        refusals, including `rate_limit_exceeded` when this ingress replica is at
        max_concurrent_requests). `stream` in the body is ignored: use generate_stream."""
        release = None
        try:
            release = self.http.slots.acquire()
            _, answer = await self._generate(_streamed(json_roundtrip(body), False))
            return answer
        except ApiError as e:
            return e.to_dict()
        finally:
            if release is not None:
                release()
            self.http.metrics.request("handle:generate", 0)

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Same chunks as the SSE /generate stream (one error JSON for refusals)."""
        self.http.metrics.request("handle:generate_stream", 0)
        try:
            release = self.http.slots.acquire()
        except ApiError as e:
            yield e.to_dict()
            return
        try:
            try:
                _, deltas = await self._generate(_streamed(json_roundtrip(body), True))
            except ApiError as e:
                yield e.to_dict()
                return
            try:
                async for out in deltas:
                    yield out
            finally:
                await deltas.aclose()
        finally:
            release()
