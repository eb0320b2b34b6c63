"""The prefix-aware router's view of a request: the keys it matches prefixes on, read from the calls
the ingress really makes (an `EngineRequest` per `generate_stream`, a list of them per
`generate_batch`; a request dict made by hand too) inside Serve's own `PendingRequest`."""

from __future__ import annotations

import asyncio

from ray.serve._private.common import RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from deployments.router import chunk_hashes, request_keys
from deployments.wire import EngineRequest

IDS = list(range(150_000, 150_040))  # ids above 2**16 occur in every Qwen3 vocabulary (151,936)


def _keys(arg) -> list:
    """`request_keys` of a call with this argument (a PendingRequest holds a future: it needs a loop)."""
    async def keys() -> list:
        metadata = RequestMetadata(request_id="r", internal_request_id="r")
        return request_keys(PendingRequest(args=[arg], kwargs={}, metadata=metadata))
    return asyncio.run(keys())


def _sent(prompt) -> EngineRequest:
    return EngineRequest(prompt=prompt, params={"max_new_tokens": 4}, request_id="r")


def test_token_id_and_text_prompts_as_the_ingress_sends_them_have_keys():
    assert _keys(_sent(IDS)) == [tuple(IDS)]
    assert _keys(_sent("system prompt")) == ["system prompt"]
    assert _keys([_sent(IDS), _sent("x")]) == [tuple(IDS), "x"]  # generate_batch
    assert _keys({"input_ids": IDS}) == [tuple(IDS)]
    assert _keys(_sent(IDS).model_dump()) == [tuple(IDS)]
    assert _keys({"method": "check_health"}) == []


def test_prompts_sharing_a_prefix_share_exactly_its_chunk_hashes():
    shared, other = chunk_hashes(tuple(IDS), 16), chunk_hashes(tuple(IDS[:32] + [7] * 8), 16)
    assert len(shared) == 2 and shared == other[:2]
    assert chunk_hashes(tuple(IDS[:32]), 16) == shared
    assert chunk_hashes(tuple([1] + IDS[1:]), 16)[0] != shared[0]
