"""OpenAI's routes (the ingress's route group `OpenAIRoutes`): /v1/completions, /v1/chat/completions
(unary or SSE chunks; vLLM's typed-read fields taken too, `deployments.vllm_names`), /v1/models, and
SGLang's /v1/decisions (served with them, as SGLang serves it beside its OpenAI routes)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.decisions import DecisionRequest, decision_reads, decisions_response
from deployments.engine_client import EngineClient
from deployments.errors import ApiError, parse
from deployments.http import ERRORS, HttpServing, Route, generation_route, request_body, sse_response
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from deployments.openai.serving import (
    ChoiceFormatter,
    OpenAIFormatter,
    chat_to_engine,
    completion_to_engine,
    shown_logprobs,
)
from deployments.tokens import TokenText
from deployments.vllm_names import vllm_body
from deployments.wire import EngineRequest, new_request_id


class OpenAIRoutes:
    """OpenAI's API for the served model (`served_model_name`, loaded from `model_path`), its tokenizer
    (and `token_text`, its tokens' texts) and `created`, the time the ingress started."""

    ROUTES = (
        generation_route("/v1/completions", "http_completions", "OpenAI completions (echo, logprobs, list prompts, "
                         "n)", CompletionRequest),
        generation_route("/v1/chat/completions", "http_chat", "OpenAI chat completions", ChatCompletionRequest),
        Route("/v1/models", "http_models", ("GET",), dict(responses={401: ERRORS[401]}, summary="The served model")),
        Route("/v1/decisions", "http_decisions", options=dict(
            responses=ERRORS, openapi_extra=request_body(DecisionRequest),
            summary="SGLang's decisions: each question's label probabilities from a one-slot read")),
    )
    HANDLES = ()

    def __init__(self, client: EngineClient, http: HttpServing, served_model_name: str, model_path: str,
                 tokenizer: Any, token_text: TokenText, created: int):
        self.client = client
        self.http = http
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.token_text = token_text
        self.created = created

    async def http_completions(self, request: Request) -> Response:
        return await self.http.serve(request, "/v1/completions", lambda body: self._vllm(body, self._completions),
                                     limited=True)

    async def _vllm(self, body: Any, route: Callable[[Any], Awaitable[Response]]) -> Response:
        """A completions or chat body with vLLM's typed-read fields taken, refusals in the client's names."""
        body, names = vllm_body(body)
        with names.errors():
            return await route(body)

    async def _completions(self, body: Any) -> Response:
        req = parse(CompletionRequest, body)
        is_dllm = (await self.client.info()).is_dllm if req.echo else False
        plan = completion_to_engine(req, self.served_model_name, self.tokenizer, is_dllm)
        reqs = [r for _, group in plan for r in group]
        echoes = [echo for echo, group in plan for _ in group]
        k = shown_logprobs(req.logprobs, reqs)
        choices = [ChoiceFormatter("completion", i, k, self.token_text, echo) for i, echo in enumerate(echoes)]
        return await self._openai("completion", reqs, choices, req.n, req.stream, req.stream_options)

    async def http_chat(self, request: Request) -> Response:
        return await self.http.serve(request, "/v1/chat/completions", lambda body: self._vllm(body, self._chat),
                                     limited=True)

    async def _chat(self, body: Any) -> Response:
        req = parse(ChatCompletionRequest, body)
        max_model_len = (await self.client.info()).max_model_len
        reqs = chat_to_engine(req, self.served_model_name, self.tokenizer, max_model_len)
        k = shown_logprobs((req.top_logprobs or 0) if req.logprobs else None, reqs)
        choices = [ChoiceFormatter("chat", i, k, self.token_text) for i in range(len(reqs))]
        return await self._openai("chat", reqs, choices, req.n, req.stream, req.stream_options)

    async def http_decisions(self, request: Request) -> Response:
        return await self.http.serve(request, "/v1/decisions", self._decisions, limited=True)

    async def _decisions(self, body: Any) -> Response:
        req = parse(DecisionRequest, body, nested=("questions",))
        reads = decision_reads(req, self.served_model_name, self.tokenizer)
        outs = await self.client.unaries([r.request for r in reads])
        return JSONResponse(decisions_response(req, reads, outs, self.served_model_name))

    async def _openai(self, kind: Literal["completion", "chat"], reqs: list[EngineRequest],
                      choices: list[ChoiceFormatter], n: int, stream: bool,
                      stream_options: StreamOptions | None) -> Response:
        fmt = OpenAIFormatter(kind, self.served_model_name, new_request_id("cmpl" if kind == "completion" else
                                                                           "chatcmpl"),
                              choices, n, include_usage=bool(stream_options and stream_options.include_usage))
        if not stream:
            return JSONResponse(fmt.full(await self.client.unaries(reqs)))
        merged = await self.client.streams(reqs)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            try:
                async for i, out in merged:
                    for chunk in fmt.chunks(i, out):
                        yield chunk
            finally:
                await merged.aclose()

        return sse_response(chunks())

    async def http_models(self, request: Request) -> Response:
        async def models() -> Response:
            try:
                max_model_len = (await self.client.info()).max_model_len
            except ApiError:  # no engine replica yet: the list still answers
                max_model_len = None
            return JSONResponse({"object": "list", "data": [{
                "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "blockserve",
                "root": self.model_path, "max_model_len": max_model_len,
                "weight_version": await self.client.weight_version()}]})

        return await self.http.serve(request, "/v1/models", models, body=False)
