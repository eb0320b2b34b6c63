"""The GPU check: `python -m bench.gpu_check` prints each part's JSON line as it finishes, then the whole
report as one JSON object (a part that raises reports its error and the others still run; the parts
stop starting new runs once their time caps are spent, so the whole check fits in about ten minutes).

0. `machine`: what the machine offers -- torch and CUDA versions, the GPU, Triton, a C compiler (Triton
   builds its launcher with one), and which attention entry points exist (vllm's flash kernels,
   torch's paged `_flash_attention_forward`, `torch.nn.attention.varlen`, FlexAttention).
1. `flash`: each flash kernel found (vllm's, torch's own) and FlexAttention against the torch backend,
   bf16, on random page tables (AR and DLLM batches: prefill chunks, denoising steps, fused commit +
   next block, decode rows).
2. `greedy`: greedy DLLM and AR outputs (tokens, step_map) of tiny checkpoints in bf16 against the
   same engine in fp32 on the same GPU; the share of identical outputs, and at each first differing
   token the fp32 run's logprob gap between the two choices (bf16 flips near-ties; a bug flips clear calls).
3. `seeded_sampling`: sampled requests with seeds, served twice in different batch mixes: identical.
4. `throughput`: an SDAR-1.7B-shaped random-weight model (hidden 2048, 28 layers, 16 / 8 heads x 128,
   MLP 6144, vocabulary 151,936, block 4) served at 1, 32 and 128 concurrent requests, against the SDAR
   reference loop on HF transformers (bench/hf_baselines.py) on the same GPU, tokens/s and output match.
   Per concurrency also forwards, engine steps, tokens per forward, the forwards' device time (CUDA
   events) against the steps' wall time, and at the highest concurrency a profiler table of the top
   device kernels and host ops over a few steps.
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

`--set FIELD=VALUE` (repeatable) sets any EngineConfig field on every model part's engine, applied after
the part's own settings and `--attention` / `--kv-block-size` / `--no-cuda-graphs`; VALUE is read as
JSON, else as a string, and an unknown field or a value the field refuses stops the check before it
starts: `python -m bench.gpu_check --only throughput --set enable_torch_compile=true`.

Where CUDA is absent it prints why and exits 0. Every part is a function of (device, dtype, ...) so
tests/test_gpu_check.py runs them on the CPU in float32 with tiny shapes. One module per concern:
`cli` (flags, the part loop and its budget), `settings` (shapes, decoding settings, traffic),
`engine_choice` (EngineChoice, `--set`), `machine`, `attention`, `agreement` (greedy, seeded sampling),
`model_engine` (the model parts' engine), `breakdown` (device time, profiler table), `throughput`
(throughput, float32_reference, sdar_4b), `random_weights`, `batch_invariance`, `trajectory`.
"""

from bench.gpu_check.cli import main

__all__ = ["main"]
