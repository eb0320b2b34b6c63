"""LLMEngine: one replica's synchronous step loop.

request -> scheduler -> batch -> runner (model) -> sampler -> decoding strategy -> stop rule ->
output builder (carrier). `step()` runs one forward for the scheduled batch and returns the
OutputChunks it made (with `overlap_schedule`: launches one half's forward, then applies the other
half's, which the device ran meanwhile). The engine only orchestrates: what to feed and how to advance is the decoding
strategy's (`engine.core.decoding`), where an output ends is the stop rule's (`engine.core.stopping`),
batch layout and scoring rows live in `engine.core.batch` / `engine.core.scoring`.

Three concerns are collaborators the engine holds: the sampler's side of a step (`sampling`,
`engine.core.step_sampling`: how each sequence's rows are picked, and the picks read back per
sequence), fault isolation (`isolation`, `engine.core.fault_isolation`: a failing step is re-run one
request at a time) and the operations on every rank (`ranks`, `engine.core.rank_operations`: memory,
the trainer's update group, weight updates, offered as the engine's own methods).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import asdict, replace
from typing import Any

from configs import EngineConfig, GenerationConfig
from engine.answers import EngineLoad, ExecutorFacts
from engine.carrier import OutputChunk, Response
from engine.core.batch import build_batch
from engine.core.decisions import Decisions, read_params
from engine.core.decoding.base import DecodingStrategy
from engine.core.fault_isolation import FaultIsolation
from engine.core.input_processing import ModelLimits, process_input
from engine.core.model_settings import EngineStats, engine_setup
from engine.core.output_builder import OutputBuilder
from engine.core.overlap import LaunchedForward, OverlapSchedule
from engine.core.rank_operations import RankOperations
from engine.core.scheduler import Scheduler
from engine.core.scoring import take_score_rows
from engine.core.sequence import SeqStatus, Sequence
from engine.core.step_plan import ScheduledSeq
from engine.core.step_sampling import StepSampling
from engine.core.stopping import StopChecker
from engine.core.trajectory import TrajectoryOutput, scoring_done, take_view_rows
from engine.core.trajectory_plan import context_tokens, plan_trajectory
from engine.delegation import Delegated
from engine.errors import RequestError
from engine.executor.base import Executor, ExecutorFactory
from engine.executor.local import LocalExecutor
from engine.kv.layer_group_pages import LayerGroupPages
from engine.kv.page_manager import KVPageManager
from engine.model.checkpoint import load_model_spec
from engine.model.source import resolve_model_path
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

def _merged(chunks: list[OutputChunk]) -> OutputChunk:
    """One chunk carrying the consecutive deltas `chunks` (at least one) of one request."""
    if len(chunks) == 1:
        return chunks[0]
    fields = asdict(Response.from_chunks(chunks))
    del fields["index"]
    return OutputChunk(**fields)


class LLMEngine:
    def __init__(self, model_path: str, config: EngineConfig | None = None,
                 executor_factory: ExecutorFactory | None = None):
        """`model_path`: a checkpoint directory, or a Hugging Face model id (local cache first)."""
        config = config or EngineConfig()
        model_path = resolve_model_path(model_path)
        self.spec = spec = load_model_spec(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.is_dllm = spec.is_dllm
        setup = engine_setup(config, spec, self.tokenizer)
        self.block_length = setup.block_length
        self.knobs_set = setup.knobs_set  # what the user set (rule defaults yield to it)
        self.config = config = setup.config
        self.paradigm = setup.paradigm
        self.mask_id = setup.mask_id
        self.decoding: DecodingStrategy = setup.decoding
        self.executor: Executor = (executor_factory or LocalExecutor)(spec, config)
        self.executor.set_dllm_block_length(self.block_length)
        groups = self.executor.kv_groups
        self.kv = (LayerGroupPages(groups, config.kv_block_size, config.enable_prefix_caching) if groups else
                   KVPageManager(self.executor.num_pages, config.kv_block_size, config.enable_prefix_caching,
                                 self.block_length))
        self.scheduler = Scheduler(config, self.kv, self.decoding)
        self.limits = ModelLimits(spec.vocab_size, config.max_model_len, config.kv_block_size, self.kv.num_pages,
                                  self.block_length, config.logprobs_mode)
        self.token_by_token_limits = replace(self.limits, block_length=None)  # a request decoded as AR's
        self.seqs: dict[str, Sequence] = {}
        self.outputs: dict[str, OutputBuilder] = {}
        self.stats = EngineStats()
        self.ranks = RankOperations(self.executor, spec, self.stats, self._land_all, self.retract_all, self.flush_cache)
        self.isolation = FaultIsolation(self.seqs, self.stats, self._forward, self._apply, self.fail)
        self._ids = itertools.count()
        self.overlap = OverlapSchedule()
        self.sampling = StepSampling(self.decoding, config.logprobs_mode)

    # the operations on every rank (memory, the trainer's update group, weight updates): `ranks`'
    release_memory = Delegated("ranks")
    resume_memory = Delegated("ranks")
    init_update_group = Delegated("ranks")
    destroy_update_group = Delegated("ranks")
    stage_weights = Delegated("ranks")
    commit_weights = Delegated("ranks")
    discard_weights = Delegated("ranks")
    update_weights = Delegated("ranks")

    @property
    def weight_version(self) -> str:
        """The name of the weights served now (every output carries it)."""
        return self.ranks.weight_version

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: GenerationConfig | None = None,
                    request_id: str | None = None, streamed: bool = True) -> str:
        """Validate and queue a request; raises RequestError (a ValueError) for bad input. `streamed`:
        its chunks come every step that made something new; False for a caller that waits for the
        whole result, which gets the chunk of its first tokens and the last (`OutputBuilder`)."""
        params = params or GenerationConfig()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise RequestError(f"request_id {request_id!r} is already in flight", "request_id")
        if params.n != 1:
            raise RequestError(f"n={params.n}: the engine runs one sample per request; expand the request with "
                               "GenerationConfig.samples() (the offline pipeline and the servers do)", "n")
        settings = self.decoding.request_settings(params, self.config, self.knobs_set)
        # a request its paradigm decodes token by token is checked as an autoregressive model's
        limits = self.token_by_token_limits if self.decoding.autoregressive(settings) else self.limits
        prompt_ids = process_input(self.tokenizer, limits, prompt, params)
        self.decoding.check_request(params, settings)
        decisions = Decisions.resolve(params, self.mask_id, self.spec.vocab_size)
        if decisions is not None:
            self.decoding.check_decisions(params, settings, decisions)
            if decisions.read_steps is not None:
                params = read_params(params, decisions)
        params = self.decoding.decoding_params(params, settings)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.spec.eos_token_ids
        stop_ids = frozenset(stop_ids)
        trajectory = plan_trajectory(prompt_ids, params, self.limits, self.mask_id, stop_ids,
                                     self.decoding.trajectory_geometry(self.spec.family.predicts_next)) \
            if params.dllm_trajectory is not None else None
        # unseeded requests draw a fresh seed: distinct on every replica and after every restart
        seed = params.random_seed if params.random_seed is not None else secrets.randbits(63)
        seq = Sequence(
            request_id=request_id, prompt_ids=prompt_ids, params=params, stop_ids=stop_ids,
            stop=StopChecker(self.tokenizer, params, stop_ids), seed=seed, arrival=next(self._ids),
            tokens=list(prompt_ids) if trajectory is None else context_tokens(prompt_ids, params, trajectory),
            table=self.kv.new_table(),
            next_score_pos=max(params.logprob_start_len, 0),
            penalty_ids=set(prompt_ids) - {self.mask_id}, trajectory=trajectory, decisions=decisions,
        )
        self.seqs[request_id] = seq
        if trajectory is None:
            self.decoding.start(seq, settings)
            self.outputs[request_id] = OutputBuilder(seq, self.is_dllm, self.decoding.replay,
                                                     self.decoding.speculation(seq), streamed)
        else:
            self.outputs[request_id] = TrajectoryOutput(seq, self.tokenizer)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def unmasking_settings(self, p: GenerationConfig) -> Any:
        """The request's decoding settings over the engine's defaults (a block-diffusion model's
        resolved knobs; None for a paradigm without per-request settings)."""
        return self.decoding.request_settings(p, self.config, self.knobs_set)

    def abort(self, request_id: str) -> OutputChunk | None:
        """Stop a request now and free its pages; returns its final chunk (finish_reason abort)."""
        return self._finish_now(request_id, "abort")

    def fail(self, request_id: str, message: str) -> OutputChunk | None:
        return self._finish_now(request_id, "error", message)

    def _finish_now(self, request_id: str, reason: str, message: str | None = None) -> OutputChunk | None:
        """End a request now. A request in a forward in flight first gets that forward's results; its
        chunks that no step returned yet come back here, merged with its final one (or alone, when
        the request finished in a forward applied early)."""
        if request_id in self.overlap.request_ids():
            self._land_all()
        earlier = self.overlap.take_ready_of(request_id)
        seq = self.seqs.get(request_id)
        if seq is None:  # unknown, or it finished in a forward applied early
            return _merged(earlier) if earlier else None
        seq.finish_reason = reason
        chunk = self.outputs[request_id].build(True, self.weight_version)
        chunk.error = message
        self._release(seq)
        return _merged([*earlier, chunk])

    def _release(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        self.decoding.release(seq)
        del self.seqs[seq.request_id]
        del self.outputs[seq.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.seqs or self.overlap.ready)

    def take_ready(self) -> list[OutputChunk]:
        """The chunks made by applying forwards in flight outside a step (an abort, a retraction, a
        memory release or a weight update applies them first); `step` returns them too."""
        return self.overlap.take_ready()

    def flush_cache(self) -> None:
        """Drop the prefix cache (requests in flight keep their own pages)."""
        self.kv.flush()

    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    def retract_all(self) -> int:
        """Give back every running request's KV pages; they wait, keeping their tokens. Returns how many."""
        self._land_all()
        return self.scheduler.retract_all()

    def load(self) -> EngineLoad:
        """What the replica holds now: requests running and waiting, KV pages, preemptions, prefix hits,
        and how its executor runs."""
        return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                          kv_pages_total=self.kv.num_pages, kv_pages_free=self.kv.num_free_pages,
                          preemptions=self.scheduler.num_preemptions, prefix_hit_tokens=self.kv.prefix_hit_tokens,
                          prefix_query_tokens=self.kv.prefix_query_tokens,
                          executor=ExecutorFacts.of(self.executor.describe()))

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[OutputChunk]:
        """One forward's worth of work; returns the chunks it made (and any made since the last step).

        With `overlap_schedule` a step launches the forward of at most half of the requests, then
        applies the previous step's forward, which ran on the device meanwhile. The requests of a
        forward in flight are not scheduled (nor preempted) until it is applied."""
        t0 = time.perf_counter()
        chunks = self.take_ready()
        worked = self._overlapped_step(chunks) if self.config.overlap_schedule else self._plain_step(chunks)
        if worked:
            self.stats.steps += 1
            self.stats.step_seconds += time.perf_counter() - t0
            self.stats.last_step_time = time.time()
        return chunks

    def _plain_step(self, chunks: list[OutputChunk]) -> bool:
        items = self.scheduler.schedule()
        if not items:
            return False
        fwd, failed = self.isolation.guarded(items, lambda: self._forward(items))
        chunks += failed if fwd is None else self._apply(fwd)
        return True

    def _overlapped_step(self, chunks: list[OutputChunk]) -> bool:
        half = (min(len(self.seqs), self.config.max_batch_size) + 1) // 2
        made, worked = self.overlap.step(lambda busy, n: self.scheduler.schedule(busy, max_seqs=n),
                                         lambda items: self.isolation.guarded(items, lambda: self._launch(items)),
                                         self._land, half)
        chunks += made
        return worked

    def _land(self, launched: LaunchedForward) -> list[OutputChunk]:
        """Read a launched forward's picks back and apply them."""
        fwd, failed = self.isolation.guarded(launched.items, lambda: self.sampling.read(launched))
        return failed if fwd is None else self._apply(fwd)

    def _land_all(self) -> None:
        """Apply every forward in flight now, before something changes what they ran on (weights, KV
        pages) or ends one of their requests; their chunks go out with the next step."""
        self.overlap.land_all(self._land)

    def _forward(self, items: list[ScheduledSeq]) -> LaunchedForward:
        """Run the model and the sampler; nothing is applied to the sequences yet."""
        return self.sampling.read(self._launch(items))

    def _launch(self, items: list[ScheduledSeq]) -> LaunchedForward:
        """Queue the forward and the sampling; on CUDA nothing here waits for the device (but a
        forward that scores input tokens reads its rows back)."""
        batch, slices = build_batch(items, self.decoding, self.config.kv_block_size, self.kv.rows)
        t = time.perf_counter()
        result = self.executor.execute(batch)
        self.stats.forward_seconds += time.perf_counter() - t
        self.stats.forwards += 1
        launched = LaunchedForward(items, batch, result, slices)
        if slices and not self.decoding.samples_logits:
            self.sampling.pick(launched)
        return launched

    def _apply(self, fwd: LaunchedForward) -> list[OutputChunk]:
        if fwd.batch.score_rows:
            take_score_rows(fwd.items, fwd.batch, fwd.result, self.outputs)
        take_view_rows(fwd.items, fwd.result, self.kv)
        committed = []  # K/V final up to here: (table, tokens, how far)
        scoring_only = []  # requests that generate nothing: they end with their prefill
        for it in fwd.items:
            seq = it.seq
            seq.num_computed = computed = it.kv_final if it.sample else it.end
            committed += ((seq.table, seq.tokens, computed),)
            if seq.params.max_new_tokens == 0:
                scoring_only += (seq,)
        self.kv.register_many(committed)
        chunks: list[OutputChunk] = []
        self.stats.unmasking_steps += self.is_dllm * len(fwd.slices)  # one step of each sequence it sampled
        for seq, error in self.decoding.apply([(sl.seq, rows) for sl, rows in zip(fwd.slices, fwd.rows)],
                                              self._finalize):
            chunks += self.isolation.fail_alone(seq, error)
        for seq in scoring_only:
            if scoring_done(seq):
                seq.finish("length", 0)
        return chunks + self._emit(fwd.items)

    def _finalize(self, seq: Sequence, written: list[int], num_final: int) -> bool:
        """The engine's part of a sequence's step (`decoding.Finalize`): the newly final tokens go to the
        stop rule, the step to the trace; True once the request is finished."""
        self.stats.generated_tokens += len(written)
        limit = seq.params.max_new_tokens
        final = num_final if num_final < limit else limit
        if final > seq.stop.num_consumed:
            decision = seq.stop.consume_final(seq.tokens, seq.prompt_len, final)
            if decision is not None:
                seq.finish(decision.reason, decision.num_tokens, decision.matched)
        output = self.outputs[seq.request_id]
        if output.want_trace:  # the step's writes inside the (possible) output
            # provisional writes (token editing) show inside the token budget (`stop_bound`), even
            # where the stop rule just ended the output before them
            bound = self.decoding.trace_bound(seq)
            event = self.decoding.trace_event(seq, [g for g in written if g < bound])
            if event is not None:
                output.add_trace(event)
        return seq.finish_reason is not None

    def _emit(self, items: list[ScheduledSeq]) -> list[OutputChunk]:
        chunks = []
        outputs, version = self.outputs, self.weight_version
        for it in items:
            seq = it.seq
            output = outputs.get(seq.request_id)
            if output is None:  # released already (failed alone)
                continue
            done = seq.finish_reason is not None
            if output.quiet and not done and output.version == version:
                continue  # between a unary request's first chunk and its last
            chunk = output.build(done, version)
            if chunk is not None:
                chunks.append(chunk)
            if done:
                self._release(seq)
        return chunks
