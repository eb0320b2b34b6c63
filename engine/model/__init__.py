"""The model: Qwen3-layer architectures (causal and block-causal, dense and MoE), checkpoint reading,
and the one checked loop that loads or stages weights. Runs on any rank; imports nothing above it."""
