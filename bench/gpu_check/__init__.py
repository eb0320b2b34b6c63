"""The GPU check: `python -m bench.gpu_check` prints each part's JSON line as it finishes, then the whole
report as one JSON object, which names the card (a part that raises reports its error and the others still
run; the parts stop starting new runs once their time caps are spent, so the whole check fits in about ten
minutes). With `--out DIR` each part's JSON is also written to DIR/<part>.json as it finishes and the
report to DIR/report.json (DIR is made; without CUDA the skip report goes there too).

0. `machine`: what the machine offers -- torch and CUDA versions, the GPU, Triton, a C compiler (Triton
   builds its launcher with one), and which attention entry points exist (vllm's flash kernels,
   torch's paged `_flash_attention_forward`, `torch.nn.attention.varlen`, FlexAttention, and what the
   triton backend lacks, if anything).
1. `flash`: each flash kernel found (vllm's, torch's own), FlexAttention and the triton backend (where
   Triton can launch) against the torch backend, bf16, on random page tables (AR and DLLM batches at 16
   query / 8 K/V heads: prefill chunks, denoising steps, fused commit + next block, decode rows); the
   triton backend also on a third, `dllm_sdar_4b`, at SDAR-4B's 32 / 8 heads x 128 (its tiles pack the
   query heads of a K/V head, so it is built for each batch's group).
2. `greedy`: greedy DLLM and AR outputs (tokens, step_map) of tiny checkpoints in bf16 against the
   same engine in fp32 on the same GPU; the share of identical outputs, and at each first differing
   token the fp32 run's logprob gap between the two choices (bf16 flips near-ties; a bug flips clear calls).
3. `seeded_sampling`: sampled requests with seeds, served twice in different batch mixes: identical, on
   the torch, flex and triton backends (one that cannot run here is reported skipped, with why).
4. `throughput`: an SDAR-1.7B-shaped random-weight model (hidden 2048, 28 layers, 16 / 8 heads x 128,
   MLP 6144, vocabulary 151,936, block 4) served at 1, 32 and 128 concurrent requests, against the SDAR
   reference loop on HF transformers (bench/hf_baselines.py) on the same GPU, tokens/s and output match.
   Per concurrency also forwards, engine steps and those that fed no prefill chunk
   (`steps_after_prefill`), tokens per forward, the forwards' device time (CUDA events) against the steps'
   wall time (also per forward: `ms_per_forward_device`, `ms_per_forward_wall`), the CUDA graphs replayed
   and captured during the run and why graphs were switched off if a capture failed (`graph_failure`);
   and at the highest concurrency a profiler table of the top device kernels and host ops over a few
   steps, with the launches onto the device per step (`kernel_launches_per_step`: kernel launches and
   graph replays counted from the profiler's host-side launch calls).
5. `float32_reference`: part 4 at one request at a time in float32, where the engine's outputs must
   match the reference loop's exactly (bf16's rounding flips confidences at the unmasking threshold).
6. `sdar_4b`: the SDAR-4B shape (hidden 2560, 36 layers, 32 / 8 heads x 128, MLP 9728) at 128
   concurrent, bf16, weights drawn at random on the device (nothing written to disk), with the same
   breakdown as part 4.
7. `batch_invariance`: one greedy request served alone and inside a batch of 128 on the SDAR-1.7B
   shape in bf16 (weights drawn on the device): same tokens, same step_map, and the largest logprob
   difference over the tokens both runs share.
8. `trajectory_scoring`: on the SDAR-1.7B shape in bf16 (weights drawn on the device), 64 greedy
   rollouts of 256 tokens from 32-token prompts (block 4, `low_confidence_dynamic` 0.85, `ignore_eos`,
   final-block replay), then all 64 trajectories scored in one call on the same engine
   (bench/trajectory_scoring.py's `measure`): each side's seconds, forwards and peak CUDA memory added,
   the ratio, the largest |scored - logged| logprob, the vocabulary. It starts only while its 90 s cap
   fits in what is left of the check's 560 s budget (one command on the borrowed machine may run 600 s),
   else it reports itself skipped.

`--attention auto|torch|flash|flex|triton`, `--kv-block-size N` and `--no-cuda-graphs` choose the model
parts' engine settings. `--set FIELD=VALUE` (repeatable) sets any EngineConfig field on every model part's
engine, applied after the part's own settings and those three; VALUE is read as JSON, else as a string,
and an unknown field or a value the field refuses stops the check before it starts:
`python -m bench.gpu_check --only throughput --set enable_torch_compile=true`.

On a borrowed machine, `bench/gpu_check/device_run.sh [DIR]` is the prepared command (DIR defaults to $OUT,
else gpu-out; python is $PYTHON, else PATH's): five runs, in order, each under `timeout` with its own cap,
within 480 s in all (GPU_CHECK_TOTAL_S; a run that no longer fits is cut to what is left or skipped) -- (a)
`--only machine flash` 90 s, (b) `--only sdar_4b --attention triton` 200 s, (c) `--only throughput --attention
triton --throughput-seconds 120` 200 s, (d) `--only seeded_sampling` 60 s, (e) `--only sdar_4b --attention
triton --set overlap_schedule=true` 150 s; GPU_CHECK_RUNS (e.g. "a b e") makes only the runs it names. A run
that fails or times out does not stop the next. Each writes DIR/<run>/ (stdout.log, stderr.log and its `--out`
files) and a line of DIR/exit_codes.txt (`RUN EXIT_CODE SECONDS CAP_S`; 124: timed out); then `python -m
bench.gpu_check.collect DIR` gathers every run's exit code, report (or the part files of a run cut short) and
stderr tail into DIR/summary.json, and the run folders are packed into DIR/runs.tar.gz, since the machine
hands back only a few files (GPU_CHECK_KEEP_FOLDERS=1 keeps them).

Where CUDA is absent it prints why and exits 0. Every part is a function of (device, dtype, ...) so
tests/bench/test_gpu_check.py runs them on the CPU in float32 with tiny shapes. One module per concern:
`cli` (flags, the part loop and its budget), `settings` (shapes, decoding settings, traffic),
`engine_choice` (EngineChoice, `--set`), `machine`, `attention`, `agreement` (greedy, seeded sampling),
`model_engine` (the model parts' engine), `breakdown` (device time, graphs, launches, profiler table),
`throughput` (throughput, float32_reference, sdar_4b), `random_weights`, `batch_invariance`,
`trajectory`, `diffusion_gemma`, `collect` (device_run.sh's summary).
"""

from bench.gpu_check.cli import main

__all__ = ["main"]
