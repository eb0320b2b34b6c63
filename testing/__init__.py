"""The testing kit: what the tests, benches, docs and training scripts build on, kept out of the runtime
packages (engine, ops, deployments, configs) so that they carry no test scaffolding and never import
transformers' model classes or diffusers on their way to serving. The runtime never imports this
package (an import-linter contract in pyproject.toml, run by tests/project/test_layers.py).

- `references/<family>.py`: each family's published decoding loop written out literally -- full
  recompute over the transformers model (or, for LLaDA2, over the checkpoint's own tensors), no KV cache,
  no batching -- the oracles the engine's outputs are compared against;
- `tiny/<family>.py`: tiny random checkpoints in the family's real on-disk format (config.json,
  safetensors under the published tensor names, tokenizer files), and the loaders that read them back
  into transformers; `tiny/tokenizer.py` the byte-level tokenizer and shard layout they all share;
- `tiny_checkpoint`, `tiny_fast_dllm`, `tiny_llada2`: the short import paths the docs' one-line writers
  use (`python -c "from testing.tiny_llada2 import write_tiny_llada2; ..."`), re-exporting the writers
  of the Qwen3-layer families (qwen3, qwen3_moe, sdar, sdar_moe), of Fast-dLLM v2 and of LLaDA2.
"""
