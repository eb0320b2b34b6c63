"""LLMEngine: one replica's synchronous step loop (request -> scheduler -> runner -> sampler/unmasker
-> carrier). `step()` runs one forward for the scheduled batch and returns the OutputChunks it made.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from configs import EngineConfig, GenerationConfig
from engine.carrier import OutputChunk
from engine.checkpoint import ModelSpec, load_model_spec, load_tokenizer
from engine.kv_cache import KVBlockManager
from engine.output import OutputBuilder
from engine.requests import RequestError, validate_request
from engine.runner import ForwardBatch, ForwardOutput, ModelRunner
from engine.sampler import RowGroup, logprob_entries, pick_tokens
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import DLLMBlock, SeqStatus, Sequence
from engine.unmasking import choose_positions, tokens_this_step


class LocalExecutor:
    """Runs the model in this process (tp=1). Ray's tensor-parallel executor has the same surface."""

    def __init__(self, spec: ModelSpec, config: EngineConfig):
        if config.tp != 1:
            raise ValueError(f"tp={config.tp}: the in-process engine runs tp=1; serve with "
                             "deployments.app:build_app for tensor parallelism over Ray")
        self.runner = ModelRunner(spec, config)

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    def set_dllm_block_length(self, block_length: int | None) -> None:
        self.runner.set_dllm_block_length(block_length)

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        return self.runner.execute(batch)

    def shutdown(self) -> None:
        pass


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    unmasking_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    last_step_time: float = 0.0


class LLMEngine:
    def __init__(self, model_path: str, config: EngineConfig | None = None, executor_factory=None):
        self.config = config = config or EngineConfig()
        self.spec = spec = load_model_spec(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.is_dllm = spec.is_dllm
        self.block_length = None
        self.mask_id = None
        if self.is_dllm:
            self.block_length = config.dllm_block_length or spec.block_size or 4
            self.mask_id = spec.mask_token_id
            if self.mask_id is None:
                self.mask_id = self.tokenizer.mask_token_id
            if self.mask_id is None:
                raise ValueError(
                    f"{model_path}: a DLLM needs a mask token: set mask_token_id in config.json "
                    "or a mask_token in the tokenizer"
                )
        self.denoising_steps = config.dllm_denoising_steps or self.block_length
        self.executor = (executor_factory or LocalExecutor)(spec, config)
        self.executor.set_dllm_block_length(self.block_length)
        self.kv = KVBlockManager(self.executor.num_pages, config.kv_block_size,
                                 config.enable_prefix_caching, self.block_length)
        self.scheduler = Scheduler(config, self.kv, self.block_length)
        self.seqs: dict[str, Sequence] = {}
        self.outputs: dict[str, OutputBuilder] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(config.seed)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: GenerationConfig | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises RequestError (a ValueError) for bad input."""
        params = params or GenerationConfig()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise RequestError(f"request_id {request_id!r} is already in flight", "request_id")
        prompt_ids = validate_request(self, prompt, params)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.spec.eos_token_ids
        seed = params.random_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        seq = Sequence(
            request_id=request_id, prompt_ids=prompt_ids, params=params, stop_ids=frozenset(stop_ids),
            generator=torch.Generator().manual_seed(seed), arrival=next(self._ids),
            tokens=list(prompt_ids), next_score_pos=max(params.logprob_start_len, 0),
        )
        if self.is_dllm:
            self._open_block(seq)
        self.seqs[request_id] = seq
        self.outputs[request_id] = OutputBuilder(seq, self.tokenizer, self.is_dllm)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def abort(self, request_id: str) -> OutputChunk | None:
        """Stop a request now and free its pages; returns its final chunk (finish_reason abort)."""
        return self._finish_now(request_id, "abort")

    def fail(self, request_id: str, message: str) -> OutputChunk | None:
        return self._finish_now(request_id, "error", message)

    def _finish_now(self, request_id: str, reason: str, message: str | None = None) -> OutputChunk | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = reason
        chunk = self.outputs[request_id].build(self.outputs[request_id].sent_tokens, finished=True)
        chunk.error = message
        self._release(seq)
        return chunk

    def _release(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]
        del self.outputs[seq.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    # ---- DLLM blocks -------------------------------------------------------------------------
    def _open_block(self, seq: Sequence) -> None:
        """Append the next block's positions as masks (the first one completes the prompt's block)."""
        b = self.block_length
        start = len(seq.tokens)
        end = (start // b + 1) * b
        seq.tokens += [self.mask_id] * (end - start)
        seq.out_steps += [None] * (end - start)
        seq.out_logprobs += [None] * (end - start)
        seq.block = DLLMBlock(start=start - start % b, end=end, masked=list(range(start, end)),
                              num_masked_at_start=end - start)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[OutputChunk]:
        t0 = time.perf_counter()
        items = self.scheduler.schedule()
        if not items:
            return []
        batch, row_owner = self._build_batch(items)
        t1 = time.perf_counter()
        result = self.executor.execute(batch)
        self.stats.forward_seconds += time.perf_counter() - t1
        self.stats.forwards += 1
        self._apply_scores(items, batch, result)
        finished = self._apply_samples(items, row_owner, result)
        chunks = self._emit(items, finished)
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.last_step_time = time.time()
        return chunks

    def _build_batch(self, items: list[ScheduledSeq]) -> tuple[ForwardBatch, list[tuple[Sequence, list[int]]]]:
        batch = ForwardBatch([], [], [], [], [], [])
        row_owner: list[tuple[Sequence, list[int]]] = []  # per sampling item: (seq, positions)
        page = self.config.kv_block_size
        k_top = 0
        for it in items:
            seq, base = it.seq, len(batch.input_ids)
            pages = seq.table.pages
            batch.input_ids += seq.tokens[it.start : it.end]
            batch.positions += range(it.start, it.end)
            batch.q_lens.append(it.end - it.start)
            batch.kv_lens.append(it.end)
            batch.slot_mapping += [pages[p // page] * page + p % page for p in range(it.start, it.end)]
            batch.page_tables.append(list(pages))
            if it.sample:
                positions = list(seq.block.masked) if seq.block else [it.end - 1]
                batch.sample_rows += [base + p - it.start for p in positions]
                row_owner.append((seq, positions))
            lo, hi = max(it.start, seq.next_score_pos), min(it.end, seq.score_end)
            if lo < hi:
                batch.score_rows += [base + p - it.start for p in range(lo, hi)]
                batch.score_targets += seq.tokens[lo + 1 : hi + 1]
                k_top = max(k_top, seq.params.logprobs or 0)
        batch.score_top_k = k_top
        return batch, row_owner

    def _apply_scores(self, items: list[ScheduledSeq], batch: ForwardBatch, result: ForwardOutput) -> None:
        i = 0
        for it in items:
            seq = it.seq
            lo, hi = max(it.start, seq.next_score_pos), min(it.end, seq.score_end)
            if lo < hi:
                n = hi - lo
                k = seq.params.logprobs or 0
                top = [row[:k] for row in result.score_top[i : i + n]] if k and result.score_top else None
                self.outputs[seq.request_id].add_input_rows(
                    result.score_values[i : i + n], batch.score_targets[i : i + n], top)
                seq.next_score_pos = hi
                i += n
            # K/V up to here are final, except a DLLM block still being denoised
            seq.num_computed = seq.block.start if (it.sample and seq.block) else it.end
            self.kv.register(seq.table, seq.tokens, seq.num_computed)

    def _apply_samples(self, items, row_owner, result: ForwardOutput) -> set[str]:
        groups, first = [], 0
        for seq, positions in row_owner:
            # index of the generated token each row decides: DLLM logits at p decide token p, AR ones token p + 1
            shift = 0 if seq.block is not None else 1
            gen_index = [p + shift - seq.prompt_len for p in positions]
            history = [t for t in seq.tokens if t != self.mask_id] if seq.params.repetition_penalty != 1.0 else []
            groups.append((first, len(positions), RowGroup(
                seq.params, seq.generator, history,
                [g < seq.params.min_new_tokens for g in gen_index], seq.stop_ids)))
            first += len(positions)
        ks = []
        for seq, positions in row_owner:
            ks += [seq.params.logprobs] * len(positions)
        done_with_logits = all(k is None for k in ks)  # no logprob rows to read from them afterwards
        tokens, confidence = (pick_tokens(result.logits, groups, self.is_dllm, overwrite=done_with_logits)
                              if groups else ([], []))
        entries = logprob_entries(result.logits, tokens, ks, self.config.logprobs_mode)
        finished: set[str] = set()
        for (first, count, _), (seq, positions) in zip(groups, row_owner):
            sl = slice(first, first + count)
            if seq.block is None:
                done = self._advance_ar(seq, tokens[sl][0], entries[sl][0])
            else:
                done = self._advance_dllm(seq, positions, tokens[sl], confidence[sl], entries[sl])
            if done:
                finished.add(seq.request_id)
        for it in items:  # scoring-only requests end with their prefill
            seq = it.seq
            if seq.params.max_new_tokens == 0 and seq.num_computed >= seq.prompt_len:
                seq.finish_reason = "length"
                seq.num_output = 0
                finished.add(seq.request_id)
        return finished

    def _advance_ar(self, seq: Sequence, token: int, entry: dict | None) -> bool:
        seq.tokens.append(token)
        seq.out_steps.append(None)
        seq.out_logprobs.append(entry)
        self.stats.generated_tokens += 1
        n = seq.num_generated_positions
        if self._is_stop(seq, n - 1):
            seq.finish_reason, seq.num_output = "stop", n
        elif n >= seq.params.max_new_tokens:
            seq.finish_reason, seq.num_output = "length", n
        return seq.finish_reason is not None

    def _advance_dllm(self, seq: Sequence, positions: list[int], tokens: list[int],
                      confidence: list[float], entries: list) -> bool:
        block = seq.block
        n = tokens_this_step(block.num_masked_at_start, self.denoising_steps, block.step_index)
        chosen = choose_positions(self.config.dllm_unmasking_strategy, positions, confidence, n,
                                  self.config.dllm_confidence_threshold)
        seq.step_counter += 1
        self.stats.unmasking_steps += 1
        block.step_index += 1
        index = {p: i for i, p in enumerate(positions)}
        for p in chosen:
            g = p - seq.prompt_len
            seq.tokens[p] = tokens[index[p]]
            seq.out_steps[g] = seq.step_counter
            seq.out_logprobs[g] = entries[index[p]]
        block.masked = [p for p in block.masked if p not in set(chosen)]
        self.stats.generated_tokens += len(chosen)
        limit = self._dllm_output_limit(seq)
        shown = [p for p in chosen if p - seq.prompt_len < limit]
        if shown:
            self.outputs[seq.request_id].add_trace({
                "step": seq.step_counter,
                "positions": [p - seq.prompt_len for p in shown],
                "token_ids": [seq.tokens[p] for p in shown],
            })
        if seq.finish_reason is not None:
            return True
        if not block.masked:
            if seq.prompt_len + seq.params.max_new_tokens <= block.end:
                seq.finish_reason, seq.num_output = "length", seq.params.max_new_tokens
                return True
            self._open_block(seq)
        return False

    def _dllm_output_limit(self, seq: Sequence) -> int:
        """Scan the revealed prefix; sets finish_reason once the output is fully determined.
        Returns how many generated positions can still be part of the output."""
        p = seq.params
        limit = p.max_new_tokens
        for g in range(seq.num_generated_positions):
            if g >= p.max_new_tokens:
                break
            if seq.out_steps[g] is None:  # still masked: positions after a later stop may matter
                for h in range(g + 1, min(seq.num_generated_positions, p.max_new_tokens)):
                    if seq.out_steps[h] is not None and self._is_stop(seq, h):
                        return h + 1
                return limit
            if self._is_stop(seq, g):
                seq.finish_reason, seq.num_output = "stop", g + 1
                return g + 1
            if g + 1 == p.max_new_tokens:
                seq.finish_reason, seq.num_output = "length", g + 1
        return limit

    @staticmethod
    def _is_stop(seq: Sequence, g: int) -> bool:
        return seq.tokens[seq.prompt_len + g] in seq.stop_ids and g >= seq.params.min_new_tokens

    def num_visible(self, seq: Sequence) -> int:
        """Leading generated tokens that are final (revealed and inside the output)."""
        if seq.num_output is not None:
            return seq.num_output
        if seq.block is None:
            return seq.num_generated_positions
        n = 0
        limit = min(seq.num_generated_positions, seq.params.max_new_tokens)
        while n < limit and seq.out_steps[n] is not None:
            n += 1
        return n

    def _emit(self, items: list[ScheduledSeq], finished: set[str]) -> list[OutputChunk]:
        chunks = []
        for it in items:
            seq = it.seq
            if seq.request_id not in self.seqs:
                continue
            builder = self.outputs[seq.request_id]
            visible = self.num_visible(seq)
            done = seq.request_id in finished
            if not done:
                cut = builder.find_stop_word(visible)
                if cut is not None:
                    seq.finish_reason, seq.num_output, visible, done = "stop", cut, cut, True
            chunk = builder.build(visible, done)
            if chunk is not None:
                chunks.append(chunk)
            if done:
                self._release(seq)
        return chunks
