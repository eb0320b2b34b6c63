"""What the parts share: the model shapes they measure, the DLLM decoding settings and the traffic."""

from __future__ import annotations

from bench.models import BenchShape
from bench.workloads import Traffic

SDAR_1_7B = BenchShape(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144)
SDAR_4B = BenchShape(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728)
BLOCK, STRATEGY, THRESHOLD = 4, "low_confidence_dynamic", 0.85
PAGE = 16
TRAFFIC = Traffic(256, (64, 256), (64, 256))  # prompts and outputs of 64-256 tokens
