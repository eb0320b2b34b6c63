"""lmdeploy's `pipeline`: prompts as lmdeploy takes them, run by the engine's offline pipeline, and
answered with lmdeploy's `Response` (plus `step_map`).

Prompts: a str is one prompt and gets the chat template (unless `do_preprocess=False`); an OpenAI
message list (`[{"role", "content"}, ...]`) is one prompt; a list of those is a batch. The stop token
that ended an output is dropped from `token_ids` (and its `step_map` and `logprobs` entries) unless
`include_stop_str_in_output`, as lmdeploy does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.carrier import OutputChunk
from engine.carrier import Response as EngineResponse
from engine.lmdeploy.configs import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    chat_messages,
    check_template,
    to_engine_config,
    to_generation_config,
)
from engine.offline import Pipeline as EnginePipeline

Message = dict[str, Any]
Prompt = str | list[Message]


@dataclass
class Response:
    """lmdeploy's Response fields; `step_map` (block diffusion; None for autoregressive models) is
    aligned with `token_ids`."""

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    logits: Any = None
    last_hidden_state: Any = None
    index: int = 0
    routed_experts: Any = None
    cached_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None
    step_map: list[int] | None = None


def _is_single(prompts: Prompt | list[Prompt]) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict))


def _drops_stop_id(out: OutputChunk | EngineResponse, config: GenerationConfig) -> bool:
    """Whether `out`'s last token is the stop id that ended it and lmdeploy would leave it out."""
    return (out.finish_reason == "stop" and isinstance(out.matched, int) and not config.include_stop_str_in_output
            and bool(out.token_ids) and out.token_ids[-1] == out.matched)


def to_response(out: OutputChunk | EngineResponse, index: int, config: GenerationConfig) -> Response:
    """An engine Response (or one streamed delta) in lmdeploy's shape."""
    cut = len(out.token_ids) - 1 if _drops_stop_id(out, config) else len(out.token_ids)
    return Response(text=out.text, generate_token_len=out.generate_token_len - (len(out.token_ids) - cut),
                    input_token_len=out.input_token_len, finish_reason=out.finish_reason,
                    token_ids=out.token_ids[:cut], logprobs=None if out.logprobs is None else out.logprobs[:cut],
                    index=index, step_map=None if out.step_map is None else out.step_map[:cut],
                    error_code=None if out.error is None else "error", error_message=out.error)


class Pipeline:
    """lmdeploy's Pipeline over `engine.pipeline`."""

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None):
        import torch

        if backend_config is not None and not isinstance(backend_config, PytorchEngineConfig):
            raise TypeError(f"backend_config: pass engine.lmdeploy.PytorchEngineConfig, not "
                            f"{type(backend_config).__name__}")
        check_template(chat_template_config)
        self.backend_config = backend_config or PytorchEngineConfig()
        self.chat_template_config = chat_template_config
        self.engine_config = to_engine_config(self.backend_config, on_cuda=torch.cuda.is_available())
        self._pipe = EnginePipeline(model_path, self.engine_config)

    @property
    def tokenizer(self) -> Any:
        return self._pipe.tokenizer

    def _engine_prompt(self, prompt: Prompt, do_preprocess: bool) -> str:
        """The text the engine gets: a str as given without preprocessing, else the chat template's rendering."""
        if isinstance(prompt, str) and not do_preprocess:
            return prompt
        if not do_preprocess:
            raise ValueError("do_preprocess=False takes str prompts only (a message list needs the chat template)")
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise ValueError("a prompt is a str or an OpenAI message list ([{'role': ..., 'content': ...}]); "
                             f"got {type(prompt).__name__}")
        return self.tokenizer.apply_chat_template(chat_messages(prompt, self.chat_template_config),
                                                  add_generation_prompt=True, tokenize=False)

    def _requests(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | list[GenerationConfig] | None,
                  do_preprocess: bool, adapter_name: str | None) -> tuple[bool, list[str], list[GenerationConfig]]:
        if adapter_name is not None:
            raise ValueError(f"adapter_name={adapter_name!r}: LoRA adapters are not supported by this engine")
        if isinstance(prompts, tuple) or isinstance(prompts, list) and any(isinstance(p, tuple) for p in prompts):
            raise ValueError("(prompt, image) tuples: this engine serves text models; pass str or message-list prompts")
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        configs = gen_config if isinstance(gen_config, list) else [gen_config or GenerationConfig()] * len(batch)
        if len(configs) != len(batch):
            raise ValueError(f"gen_config: a list needs one GenerationConfig per prompt ({len(batch)}), "
                             f"got {len(configs)}")
        return single, [self._engine_prompt(p, do_preprocess) for p in batch], configs

    def infer(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | list[GenerationConfig] | None = None,
              do_preprocess: bool = True, adapter_name: str | None = None, use_tqdm: bool = False
              ) -> Response | list[Response]:
        """One Response for one prompt, a list for a batch (in prompt order)."""
        single, texts, configs = self._requests(prompts, gen_config, do_preprocess, adapter_name)
        outs = self._pipe(texts, [to_generation_config(c) for c in configs])
        responses = [to_response(out, i, c) for i, (out, c) in enumerate(zip(outs, configs))]
        return responses[0] if single else responses

    __call__ = infer
    batch_infer = infer

    def stream_infer(self, prompts: Prompt | list[Prompt], sessions: Any = None,
                     gen_config: GenerationConfig | list[GenerationConfig] | None = None, do_preprocess: bool = True,
                     adapter_name: str | None = None, stream_response: bool = True) -> Iterator[Response]:
        """Response deltas as the engine makes them, each with its prompt's `index`, the prompts decoded
        together; `stream_response=False`: one whole Response per prompt as each finishes."""
        if sessions is not None:
            raise ValueError("sessions are not supported by this engine; leave sessions=None")
        _, texts, configs = self._requests(prompts, gen_config, do_preprocess, adapter_name)
        engine_configs = [to_generation_config(c) for c in configs]
        if stream_response:
            for index, chunk in self._pipe.stream_batch(texts, engine_configs):
                yield to_response(chunk, index, configs[index])
            return
        whole: dict[int, EngineResponse] = {}
        for index, chunk in self._pipe.stream_batch(texts, engine_configs):
            whole.setdefault(index, EngineResponse(index=index)).add(chunk)
            if chunk.finished:
                yield to_response(whole.pop(index), index, configs[index])

    def close(self) -> None:
        self._pipe.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pipeline(model_path: str, backend_config: PytorchEngineConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None, log_level: str = "WARNING",
             max_log_len: int | None = None, trust_remote_code: bool = False, speculative_config: Any = None,
             **kwargs: Any) -> Pipeline:
    """lmdeploy's `pipeline(...)`. The checkpoint never runs code (trust_remote_code changes nothing);
    `log_level` and `max_log_len` are lmdeploy's logging knobs and change nothing here."""
    if speculative_config is not None:
        raise ValueError("speculative_config: speculative decoding is not supported by this engine")
    if kwargs:
        raise TypeError(f"pipeline() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
    return Pipeline(model_path, backend_config, chat_template_config)
