"""The model runner: owns one model shard and its KV cache, turns a ForwardBatch into logits.

`ForwardBatch` and `ForwardOutput` (engine.worker.forward_batch) are plain data so the same batch
can be sent to every tensor-parallel worker. Only rows whose logits are used reach the LM head:
`sample_rows` (positions to sample or unmask) return full logits rows; `score_rows` (input-token
scoring) are projected in chunks of `logprobs_chunk_rows` and reduced to (value, top-k) right away.

Between rollouts an RL trainer changes what the runner holds: weight updates arrive in two phases
(`stage_weights` checks and copies this rank's slices aside, `commit_weights` swaps them in,
`discard_weights` drops them; see engine.worker.weight_staging), and `release_memory` / `resume_memory` free
and restore the weights and the KV cache. Released weights come back from where they came from:
the checkpoint directory last loaded in full, or, once tensors or a broadcast changed them, a copy
of this rank's weights taken at release (host memory on CUDA; a safetensors file in a temporary
directory on CPU, where host memory is what is being freed).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from configs import EngineConfig
from engine.errors import WeightUpdateError
from engine.heap import return_freed_memory
from engine.model.checkpoint import ModelSpec, iter_weights
from engine.model.families import build_network
from engine.model.interfaces import (
    Network,
    checks_loaded,
    fixes_block_length,
    has_draft_adapter,
    has_layer_groups,
)
from engine.model.layers.parallel import TPContext
from engine.model.loading import load_weights
from engine.worker.cuda_graphs import StepGraphs, cuda_capture
from engine.worker.forward_batch import ForwardBatch, ForwardOutput
from engine.worker.kv_sizing import num_kv_pages
from engine.worker.layer_groups import LayerGroupPasses
from engine.worker.logits_processing import filter_for_sampling, penalize_
from engine.worker.step_upload import GraphPadding, StepUploader, upload_step
from engine.worker.update_group import init_custom_process_group
from engine.worker.weight_sources import DiskWeights, WeightSource
from engine.worker.weight_staging import install_weights, local_weights, shape_template, stage_weights
from ops.attention import AttentionMetadata, make_attention_backend
from ops.cpu_linear import convert_for_cpu

log = logging.getLogger(__name__)


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device, spec: ModelSpec | None = None) -> torch.dtype:
    """`auto`: float32 on CPU; on CUDA the checkpoint's `torch_dtype` (bfloat16 when it names none)."""
    if config.dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return getattr(torch, spec.torch_dtype) if spec is not None and spec.torch_dtype else torch.bfloat16
    return getattr(torch, config.dtype)


MEMORY_TAGS = ("weights", "kv_cache")  # what a runner can free and restore


def allocate_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tp: TPContext | None) -> Network:
    """The model shard built on the meta device (no random init) and allocated once, unfilled."""
    with torch.device("meta"):
        model = build_network(spec, tp)
    return model.materialize(device, dtype).eval()


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tp: TPContext | None) -> Network:
    """The model shard in `dtype` on `device`, filled with this rank's slices read from the
    memory-mapped safetensors files of the checkpoint."""
    model = allocate_model(spec, device, dtype, tp)
    load_weights(model, iter_weights(spec.path))
    if checks_loaded(model):  # checks across tensors a family makes once all are in
        model.check_loaded()
    return model


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim written over `x` (same values as `x.log_softmax(-1)`): no second
    rows x vocab tensor to allocate and fault in."""
    if not hasattr(torch, "_log_softmax"):
        return x.log_softmax(-1)
    with torch.inference_mode():
        return torch._log_softmax(x, -1, False, out=x)


class ModelRunner:
    def __init__(self, spec: ModelSpec, config: EngineConfig, tp: TPContext | None = None):
        self.spec, self.config = spec, config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device, spec)
        network = spec.family.network  # a network of layer groups brings its own backend for its passes
        self.backend = (network.attention_backend(spec, config.attention_backend, self.device)
                        if has_layer_groups(network) else
                        make_attention_backend(config.attention_backend, self.device, self.dtype,
                                               config.kv_block_size, spec.head_dim,
                                               spec.num_attention_heads // spec.num_key_value_heads))
        self.dllm_block_length, self.tp = None, tp or TPContext()
        self.model: Network | None = self._prepare(build_model(spec, self.device, self.dtype, tp))
        # a network whose layers form groups of their own K/V geometry sizes and runs them itself
        self.layer_groups = (LayerGroupPasses(self.model, config, self.device, self.dtype, self.tp.size,
                                              config.max_model_len or spec.max_position_embeddings, self.backend)
                             if has_layer_groups(network) else None)
        self.num_pages = (max(self.layer_groups.pools.values()) if self.layer_groups
                          else num_kv_pages(spec, config, self.device, self.dtype))
        #: per layer group (pages, sliding window) when the network's groups keep their own pools
        self.kv_groups = self.layer_groups.groups if self.layer_groups else None
        self.graphs = self._step_graphs()
        self.graph_failure: str | None = None  # why graphs were switched off after a failed capture
        self.null_page = self.num_pages  # past the pages the engine hands out; allocated when graphs run
        self.kv_caches = self._allocate_kv()
        self.num_forwards = 0
        self.uploader = StepUploader()  # each forward's metadata in one host->device copy
        self.update_groups: dict[str, object] = {}  # weight update groups joined, by name
        self._staged: tuple[dict[str, torch.Tensor], str | None] | None = None  # (slices, their checkpoint)
        self._origin: str | None = spec.path  # the checkpoint the live weights equal; None once changed
        self._backup: dict[str, torch.Tensor] | Path | None = None  # released weights no checkpoint holds

    def _graphs_unmet(self) -> list[str]:
        """Why this runner's steps cannot replay CUDA graphs (empty: they can)."""
        unmet = []
        if not self.config.cuda_graphs:
            unmet.append("cuda_graphs is false")
        if self.device.type != "cuda":
            unmet.append(f"the device is {self.device.type}, not CUDA")
        if self.tp.size != 1:
            unmet.append(f"tensor parallelism (tp={self.tp.size}) runs eagerly")
        if not self.backend.graph_safe:
            unmet.append(f"the {self.backend.name} attention backend is not graph-safe (attention_backend='triton' is)")
        return unmet

    def _step_graphs(self) -> StepGraphs | None:
        """CUDA graphs for every step (engine.worker.cuda_graphs) where they run: switched on, on CUDA, on
        one GPU, with a graph-safe attention backend (`triton`)."""
        if self._graphs_unmet():
            return None
        # the longest sequence the cache is sized for (a DLLM block may run past max_model_len)
        longest = (self.config.max_model_len or self.spec.max_position_embeddings) + 64
        return StepGraphs(self.config.max_batch_size + 1, -(-longest // self.config.kv_block_size),
                          cuda_capture(torch.cuda.graph_pool_handle()))

    def describe(self) -> dict[str, object]:
        """How this runner's forwards run, for the engine's stats and /get_server_info: its attention
        backend, and whether CUDA graphs replay (graphs captured, replays so far) or why not."""
        if self.graphs is not None:
            graphs = {"state": "on", "captured": self.graphs.captures, "replays": self.graphs.replays}
        else:
            graphs = {"state": "off", "why": self.graph_failure or "; ".join(self._graphs_unmet())}
        return {"attention_backend": self.backend.name, "cuda_graphs": graphs}

    def _prepare(self, model: Network) -> Network:
        """A loaded model ready to serve: on CPU every linear on oneDNN packed weights; with
        `enable_torch_compile` its elementwise work compiled into fused kernels (ops.fused)."""
        if self.device.type == "cpu":
            embedding = model.embed_tokens
            convert_for_cpu(model, shared=(embedding.weight,))
        if self.config.enable_torch_compile:
            model.use_compiled_elementwise()
        # after the conversion: the adapter hooks the modules that serve (a family without one never sees the
        # switch on: the knob table refuses it at engine start, or an autoregressive engine ignores it)
        if self.config.dllm_draft_lora and has_draft_adapter(model):
            model.load_draft_lora()
        return model

    def _allocate_kv(self) -> list[tuple[torch.Tensor, ...]]:
        if self.layer_groups is not None:
            return self.layer_groups.allocate()
        kvh = self.spec.num_key_value_heads // self.tp.size
        pages = self.num_pages + (self.graphs is not None)  # the null page padded graph steps use
        shape = (2, pages, self.config.kv_block_size, kvh, self.spec.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device).unbind(0)
                for _ in range(self.spec.num_hidden_layers)]

    # ---- weight updates (two-phase; engine.worker.weight_staging drives every rank) ----------------------
    def stage_weights(self, source: WeightSource) -> None:
        """Check and copy aside this rank's slice of every tensor of `source`; raises
        WeightUpdateError (naming the tensor, and the rank under tensor parallelism) if refused."""
        self._staged = None
        try:
            if self.model is None:
                raise WeightUpdateError("the weights are released: resume_memory_occupation(['weights']) first")
            weights = source.named_weights(self.update_groups, self.device)
            staged = stage_weights(shape_template(self.spec, self.tp), weights, source.complete,
                                   self.device, self.dtype)
        except WeightUpdateError as e:
            if self.tp.size == 1:
                raise
            raise WeightUpdateError(f"tensor-parallel rank {self.tp.rank}: {e}") from e
        self._staged = staged, source.path if isinstance(source, DiskWeights) else None

    def commit_weights(self) -> None:
        if self._staged is None:
            raise RuntimeError("commit_weights without staged weights")
        (weights, origin), self._staged = self._staged, None
        install_weights(self.model, weights)
        self._origin = origin

    def discard_weights(self) -> None:
        self._staged = None
        return_freed_memory(self.device)

    def init_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str, timeout_s: float) -> None:
        """Join the trainer's weight update group as rank `rank_offset` + this tensor-parallel rank;
        WeightUpdateError naming who is missing when the group does not form within `timeout_s`."""
        if group_name in self.update_groups:
            raise WeightUpdateError(f"weight update group {group_name!r} already exists; destroy it first")
        self.update_groups[group_name] = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank_offset + self.tp.rank, group_name,
            join_timeout_s=timeout_s)

    def destroy_update_group(self, group_name: str, missing_ok: bool = False) -> None:
        group = self.update_groups.pop(group_name, None)
        if group is None:
            if missing_ok:
                return
            raise WeightUpdateError(f"no weight update group {group_name!r} "
                                    f"(groups: {sorted(self.update_groups) or 'none'})")
        torch.distributed.destroy_process_group(group)

    # ---- memory release ----------------------------------------------------------------------
    def release_memory(self, tags: list[str]) -> None:
        """Free the weights and/or the KV cache (their contents are gone; see `resume_memory`)."""
        if "weights" in tags and self.model is not None:
            if self._origin is None:
                self._backup = self._take_backup()
            self.model = None
        if "kv_cache" in tags:
            self.kv_caches = []
        if self.graphs is not None:  # captured graphs hold the old tensors and their memory pool
            self.graphs.clear()
        return_freed_memory(self.device)

    def resume_memory(self, tags: list[str]) -> None:
        """Allocate again what `release_memory` freed: the weights reloaded exactly as they were, the
        KV cache zeroed (the engine recomputes whatever it needs)."""
        if "weights" in tags and self.model is None:
            self.model = self._prepare(self._restore_weights())
        if "kv_cache" in tags and not self.kv_caches:
            self.kv_caches = self._allocate_kv()

    def _take_backup(self) -> dict[str, torch.Tensor] | Path:
        weights = local_weights(self.model)
        if self.device.type != "cpu":
            return weights
        path = Path(tempfile.mkdtemp(prefix="blockserve-weights-")) / f"rank{self.tp.rank}.safetensors"
        save_file(weights, str(path))
        return path

    def _restore_weights(self) -> Network:
        if self._backup is None:
            spec = dataclasses.replace(self.spec, path=self._origin)
            return build_model(spec, self.device, self.dtype, self.tp)
        model = allocate_model(self.spec, self.device, self.dtype, self.tp)
        backup, self._backup = self._backup, None
        install_weights(model, backup if isinstance(backup, dict) else load_file(str(backup)))
        if isinstance(backup, Path):
            shutil.rmtree(backup.parent, ignore_errors=True)
        return model

    def set_dllm_block_length(self, block_length: int | None) -> None:
        """The engine's block length, before anything runs; a network that fixes it (LLaDA2.2's block
        routing: `check_block_length`) refuses another one here."""
        if fixes_block_length(self.model):
            self.model.check_block_length(block_length)
        self.dllm_block_length = block_length

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        """One forward. Its metadata -- the batch's lists and the attention backend's plan -- goes to the
        device in one copy and the attention metadata is prepared before the model runs, so nothing in
        `model.forward` waits on the host. Where graphs run, the step is padded to its token bucket and
        replays that bucket's CUDA graph (engine.worker.cuda_graphs)."""
        if batch.pass_kinds:  # encoder / canvas passes of a layer-group network
            self.num_forwards += 1
            return self.layer_groups.execute(self.model, self.kv_caches, batch)
        drafts = any(batch.draft_rows)  # rows that run the draft adapter: an eager forward
        bucket = None if drafts else self._graph_bucket(batch)  # the token bucket of the graph it replays, or None
        padding = None if bucket is None else GraphPadding(bucket, self.graphs.max_seqs, self.null_page)
        step, meta = upload_step(batch, self.backend, self.uploader, self.device, self.config.kv_block_size,
                                 self.dllm_block_length, padding)
        if batch.kv_copy_src:
            self._copy_kv(batch.kv_copy_src, batch.kv_copy_dst)
        if drafts:
            flags = torch.tensor(batch.draft_rows, device=self.device)
            rows = flags.repeat_interleave(torch.tensor(batch.q_lens, device=self.device))
            self.backend.prepare(meta)
            hidden = self.model(step["input_ids"], meta.positions, self.kv_caches, meta, self.backend, draft_rows=rows)
        else:
            hidden = self._forward(step, meta) if bucket is None else self._graph_forward(bucket, step, meta)
        self.num_forwards += 1
        logits = self.model.logits(hidden[step["sample_rows"]])
        out = ForwardOutput(logits=logits)
        if batch.score_rows:
            self._score(hidden, batch, out)
        return out

    def _forward(self, step: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """The attention metadata prepared, then the model: final hidden states of every fed row (what a
        CUDA graph captures)."""
        self.backend.prepare(meta)
        return self.model(step["input_ids"], meta.positions, self.kv_caches, meta, self.backend)

    def _graph_bucket(self, batch: ForwardBatch) -> int | None:
        """The token bucket whose CUDA graph `batch` replays, or None (no graphs, or a step too large)."""
        if self.graphs is None:
            return None
        return self.graphs.bucket(len(batch.input_ids), len(batch.q_lens), batch.page_tables.shape[1])

    def _graph_forward(self, bucket: int, step: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """`_forward` through the step graphs; a capture that fails switches graphs off (logged, and kept in
        `graph_failure` for /get_server_info) and the step runs eagerly."""
        inputs = {name: value for name, value in step.items() if name not in ("sample_rows", "page_tables")}
        try:
            return self.graphs.run(bucket, inputs, meta, self._forward, (self.model, self.kv_caches[0][0]))
        except RuntimeError as e:
            self.graph_failure = f"capturing the graph of {bucket}-token steps failed: {e}"
            log.warning("CUDA graphs switched off, every step runs eagerly: %s", self.graph_failure)
            self.graphs = None
            meta.extra = None
            return self._forward(step, meta)

    def _copy_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of flat cache slots `src` to `dst` in every layer (a query group that shares a
        sequence's pages gets its own copy of a page the group writes into)."""
        src_t, dst_t = self._tensor(src), self._tensor(dst)
        for cache in self.kv_caches:
            for part in cache:
                flat = part.view(-1, *part.shape[2:])
                flat.index_copy_(0, dst_t, flat.index_select(0, src_t))

    def _score(self, hidden: torch.Tensor, batch: ForwardBatch, out: ForwardOutput) -> None:
        """Each scored row's value at its target (and the top-k, and the entropy on request), the LM
        head run on `logprobs_chunk_rows` rows at a time. Rows with a penalty or a sampling filter are
        first processed as the sampler would; `*_logits` modes report the (processed) logits, the
        others their log_softmax."""
        as_logits = self.config.logprobs_mode in ("raw_logits", "processed_logits")
        k = batch.score_top_k
        out.score_top = [] if k > 0 else None
        out.score_entropy = [] if batch.score_entropy else None
        penalty_starts = [p.first for p in batch.score_penalties]
        filter_starts = [f.first for f in batch.score_filters]
        step = self.config.logprobs_chunk_rows
        for i in range(0, len(batch.score_rows), step):
            rows = self._tensor(batch.score_rows[i : i + step])
            values = self.model.logits(hidden[rows])
            end = i + len(rows)
            for p in batch.score_penalties[max(bisect.bisect_right(penalty_starts, i) - 1, 0):]:
                if p.first >= end:
                    break
                lo, hi = max(p.first, i), min(p.first + len(p.suppress), end)
                if lo < hi:
                    penalize_(values[lo - i : hi - i], p.repetition_penalty, p.penalty_ids,
                              p.suppress[lo - p.first : hi - p.first], p.stop_ids)
            for f in batch.score_filters[max(bisect.bisect_right(filter_starts, i) - 1, 0):]:
                if f.first >= end:
                    break
                lo, hi = max(f.first, i), min(f.first + f.count, end)
                if lo < hi:
                    values[lo - i : hi - i] = filter_for_sampling(values[lo - i : hi - i], f.params)
            if not as_logits:
                values = log_softmax_(values) if self.device.type == "cpu" else values.log_softmax(-1)
            targets = self._tensor(batch.score_targets[i : i + step])
            out.score_values += values.gather(1, targets[:, None])[:, 0].tolist()
            if k > 0:
                top_v, top_i = values.topk(k, dim=-1)
                out.score_top += [list(zip(v, t)) for v, t in zip(top_v.tolist(), top_i.tolist())]
            if out.score_entropy is not None:
                probs = values.softmax(-1) if as_logits else values.exp()
                out.score_entropy += torch.special.entr(probs).sum(-1).tolist()
            del values
