"""The offline pipeline: `pipeline(model)` runs the engine in this process, lmdeploy-style.

`pipe(prompts, gen_config)`: a str or a flat list of token ids is one prompt and gets one Response;
a list of those is a batch and gets a list. `gen_config` is one GenerationConfig for every prompt, or
a list with one per prompt (as lmdeploy's pipeline takes them). A config with `n > 1` gives n
Responses for its prompt (`index` 0..n-1, sample i seeded `random_seed + i`), in prompt order: a
single prompt then gets a list too.

`update_weights_from_disk` / `update_weights_from_tensor` swap the weights between calls, as the
serving engine does for an RL trainer (engine.worker.weight_staging).
"""

from __future__ import annotations

from collections.abc import Iterator

from configs import EngineConfig, GenerationConfig
from engine.carrier import OutputChunk, Response
from engine.core.llm_engine import LLMEngine
from engine.executor.base import ExecutorFactory
from engine.worker.runner import MEMORY_TAGS
from engine.worker.weight_sources import DiskWeights, tensor_source

Prompt = str | list[int]


def _is_single(prompts: Prompt | list[Prompt]) -> bool:
    """A str, or a flat list of ints, is ONE prompt; a list of those is a batch."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts)


class Pipeline:
    def __init__(self, model_path: str, engine_config: EngineConfig | None = None,
                 executor_factory: ExecutorFactory | None = None):
        """`executor_factory(spec, config)` builds how the engine reaches its ranks: None runs tp=1 in this
        process; `engine.executor.ray_tp.RayTPExecutor` runs `config.tp` shards as Ray actors of the Ray
        cluster this process is connected to."""
        self.engine = LLMEngine(model_path, engine_config or EngineConfig(), executor_factory)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def __call__(self, prompts: Prompt | list[Prompt],
                 gen_config: GenerationConfig | list[GenerationConfig] | None = None) -> Response | list[Response]:
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("prompts is empty: pass a string, a list of token ids, or a list of those")
        if isinstance(gen_config, list):
            if len(gen_config) != len(batch):
                raise ValueError(f"gen_config: a list needs one GenerationConfig per prompt ({len(batch)}), "
                                 f"got {len(gen_config)}")
            configs = gen_config
        else:
            configs = [gen_config] * len(batch)
        ids: list[tuple[str, int]] = []
        try:
            for p, config in zip(batch, configs):
                for index, sample in enumerate((config or GenerationConfig()).samples()):
                    ids.append((self.engine.add_request(p, sample, streamed=False), index))
        except ValueError:
            for rid, _ in ids:
                self.engine.abort(rid)
            raise
        responses = {rid: Response(index=index) for rid, index in ids}
        for chunk in self._drain(set(responses)):
            responses[chunk.request_id].add(chunk)
        out = [responses[rid] for rid, _ in ids]
        return out[0] if single and len(out) == 1 else out

    def stream(self, prompt: Prompt, gen_config: GenerationConfig | None = None) -> Iterator[OutputChunk]:
        """Yield one request's OutputChunk deltas as the engine makes them (one sample: n must be 1)."""
        for _, chunk in self.stream_batch([prompt], [gen_config]):
            yield chunk

    def stream_batch(self, prompts: list[Prompt], gen_configs: list[GenerationConfig | None],
                     max_active: int | None = None) -> Iterator[tuple[int, OutputChunk]]:
        """Yield `(prompt index, OutputChunk delta)` for every prompt as the engine makes them, the
        prompts decoded together: at most `max_active` in the engine at once (None: all), the next
        one added as soon as one finishes. One sample per prompt (n must be 1). Requests still in the
        engine when the caller stops iterating are aborted."""
        if len(gen_configs) != len(prompts):
            raise ValueError(f"gen_configs: one GenerationConfig per prompt ({len(prompts)}), got {len(gen_configs)}")
        if any(c is not None and c.n != 1 for c in gen_configs):
            raise ValueError("streaming follows one sample per prompt: use n=1 (or pipe(...) for n samples)")
        if max_active is not None and max_active < 1:
            raise ValueError(f"max_active={max_active}: must be at least 1")
        limit = max_active or max(len(prompts), 1)
        queued = iter(enumerate(zip(prompts, gen_configs)))
        active: dict[str, int] = {}  # request id -> prompt index
        try:
            while True:
                while len(active) < limit and (nxt := next(queued, None)) is not None:
                    index, (prompt, config) = nxt
                    active[self.engine.add_request(prompt, config)] = index
                if not active:
                    return
                for chunk in self.engine.step():
                    index = active.get(chunk.request_id)
                    if index is None:
                        continue
                    if chunk.finished:
                        del active[chunk.request_id]
                    yield index, chunk
        finally:
            for rid in active:
                self.engine.abort(rid)

    def _drain(self, pending: set[str]) -> Iterator[OutputChunk]:
        while pending:
            for chunk in self.engine.step():
                if chunk.request_id in pending:
                    yield chunk
                    if chunk.finished:
                        pending.discard(chunk.request_id)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Swap in every tensor of a checkpoint of the same architecture (all or nothing; raises
        WeightUpdateError naming what does not fit). Returns the new weight_version."""
        return self.engine.update_weights(DiskWeights(str(model_path)), weight_version)

    def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None,
                                   load_format: str | None = None) -> str:
        """Swap in full tensors by checkpoint name (or SGLang's `flattened_bucket` payload)."""
        return self.engine.update_weights(tensor_source(named_tensors, load_format), weight_version)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the weights and/or the KV cache (`["weights", "kv_cache"]`, None = both) until
        `resume_memory`; requests running keep their tokens and resume after."""
        self.engine.release_memory(list(MEMORY_TAGS if tags is None else tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Restore what `release_memory` freed (None = both)."""
        self.engine.resume_memory(list(MEMORY_TAGS if tags is None else tags))

    def close(self) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        self.engine.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(model_path: str, engine_config: EngineConfig | None = None) -> Pipeline:
    return Pipeline(model_path, engine_config)
