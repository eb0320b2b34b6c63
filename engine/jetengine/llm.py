"""JetEngine's `LLM` over the engine's offline pipeline.

`generate` / `generate_streaming` answer one dict per prompt, in order: `text`, `token_ids`
(generated only, ending at the stop token), `trajectory` and `first_unmask_times` (both the step that
revealed each token: the engine's `step_map`), `logprobs` and `entropies` (one float per token, of the
distribution it was sampled from at the step that revealed it). The logprobs and entropies come from
scoring the finished rollout (the engine's trajectory scoring: one forward per block, exactly the
input of each revealing step).

Between iterations a trainer swaps weights with `reload_parameters(module)` /
`reload_from_hf_model(module)` (the module's state dict, by checkpoint tensor name) and frees memory
with `offload_parameters()` / `free_all_resources()`; the next reload brings the weights back.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from configs import GenerationConfig
from configs.knobs import DIFFUSION
from configs.trajectory import DllmTrajectory
from engine.carrier import Response
from engine.core.decoding import describe_paradigm, paradigm_of
from engine.jetengine.params import Config, SamplingParams, to_engine_config, to_generation_config
from engine.local_ray import start_local_ray
from engine.model.checkpoint import load_model_spec
from engine.model.source import resolve_model_path
from engine.offline import Pipeline

Prompt = str | list[int]


def _scoring(generation: GenerationConfig, rollout: Response) -> GenerationConfig:
    """Score `rollout` under the sampling settings it was generated with: its logprobs and entropies."""
    return generation.model_copy(update=dict(
        max_new_tokens=0, logprobs=0, return_dllm_replay=False,
        dllm_trajectory=DllmTrajectory.from_response(rollout, return_entropy=True)))


def _output(rollout: Response, score: Response | None) -> dict[str, Any]:
    step_map = list(rollout.step_map or [])
    return {"text": rollout.text, "token_ids": list(rollout.token_ids), "trajectory": step_map,
            "first_unmask_times": list(step_map),
            "logprobs": [] if score is None else [next(iter(entry.values())) for entry in score.logprobs or []],
            "entropies": [] if score is None else list(score.entropy or [])}


class LLM:
    """JetEngine's `LLM(model, **config)`: `config` takes the fields of JetEngine's Config."""

    def __init__(self, model: str, **config: Any):
        import torch

        self.config = Config(**config)
        path = resolve_model_path(model)
        spec = load_model_spec(path)
        paradigm = paradigm_of(spec.family)
        if paradigm not in DIFFUSION:  # block and sub-block decoding
            raise ValueError(f"{model}: JetEngine runs block-diffusion models; this checkpoint (model_type "
                             f"{spec.family.model_type!r}) is {describe_paradigm(paradigm)}: use engine.pipeline or "
                             "engine.lmdeploy")
        engine_config = to_engine_config(self.config, spec.max_position_embeddings, on_cuda=torch.cuda.is_available())
        self._own_ray = False
        self._pipe = Pipeline(path, engine_config.model_copy(update={"logprobs_mode": "processed_logprobs"}),
                              self._tp_executor() if engine_config.tp > 1 else None)
        engine = self._pipe.engine
        if self.config.mask_token_id != -1 and self.config.mask_token_id != engine.mask_id:
            self._pipe.close()
            raise ValueError(f"mask_token_id={self.config.mask_token_id}: the checkpoint's mask token is "
                             f"{engine.mask_id}; pass that (or leave mask_token_id unset)")
        self._released: list[str] = []

    def _tp_executor(self) -> Any:
        """The Ray executor for `tensor_parallel_size > 1`: ranks 1.. as Ray actors of the cluster this
        process is connected to, else of a new one on this machine that listens on loopback only (shut
        down with the LLM)."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            start_local_ray(num_cpus=max(self.config.tensor_parallel_size, os.cpu_count() or 1),
                            include_dashboard=False, logging_level="warning", log_to_driver=False)
            self._own_ray = True
        from engine.executor.ray_tp import RayTPExecutor

        return RayTPExecutor

    @property
    def tokenizer(self) -> Any:
        return self._pipe.tokenizer

    def _ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (a str is encoded as JetEngine does, without added special tokens)."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) \
            else list(prompt)

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict[str, Any]]:
        """Every prompt at once (up to the engine's `max_num_seqs` running); one dict per prompt, in order.
        `use_tqdm` is accepted (no progress bar is drawn)."""
        return self._generate(prompts, sampling_params, None)

    def generate_streaming(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                           max_active: int | None = None, use_tqdm: bool = True) -> list[dict[str, Any]]:
        """As `generate`, with at most `max_active` prompts in the engine at once: the next prompt starts
        as soon as one finishes."""
        if max_active is not None and max_active < 1:
            raise ValueError(f"max_active={max_active}: must be at least 1")
        return self._generate(prompts, sampling_params, max_active or self.config.max_num_seqs)

    def _generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                  max_active: int | None) -> list[dict[str, Any]]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: a list needs one SamplingParams per prompt ({len(prompts)}), "
                             f"got {len(params)}")
        if not prompts:
            return []
        block = self._pipe.engine.block_length
        for sp in params:
            if sp.block_length != block:
                raise ValueError(f"SamplingParams.block_length={sp.block_length}: this model decodes blocks of {block} "
                                 "tokens (LLM's block_length); the block length cannot change per request")
        self._resume()
        ids = [self._ids(p) for p in prompts]
        configs = [to_generation_config(sp) for sp in params]
        rollouts = [Response(index=i) for i in range(len(ids))]
        for index, chunk in self._pipe.stream_batch(ids, configs, max_active):
            rollouts[index].add(chunk)
        scored = [i for i, r in enumerate(rollouts) if r.token_ids]
        scores = dict(zip(scored, self._pipe([ids[i] for i in scored], [_scoring(configs[i], rollouts[i])
                                                                        for i in scored]))) if scored else {}
        return [_output(r, scores.get(i)) for i, r in enumerate(rollouts)]

    # ---- weights between training iterations ---------------------------------------------------
    def reload_parameters(self, hf_model: Any) -> None:
        """Load the weights of a torch module (its state dict, by checkpoint tensor name)."""
        self._resume()
        self._pipe.update_weights_from_tensor(list(hf_model.state_dict().items()))

    reload_from_hf_model = reload_parameters

    def offload_parameters(self, include_buffers: bool = False) -> None:
        """Free the weights' memory until the next reload (or the next generate, which restores them)."""
        self._release(["weights"])

    def free_all_resources(self) -> None:
        """Free the weights and the KV cache until the next reload or generate."""
        self._release(["weights", "kv_cache"])

    def _release(self, tags: list[str]) -> None:
        todo = [t for t in tags if t not in self._released]
        if todo:
            self._pipe.release_memory(todo)
            self._released += todo

    def _resume(self) -> None:
        if self._released:
            self._pipe.resume_memory(self._released)
            self._released = []

    def shutdown(self) -> None:
        self._pipe.close()
        if self._own_ray:
            import ray

            ray.shutdown()
            self._own_ray = False

    exit = shutdown
