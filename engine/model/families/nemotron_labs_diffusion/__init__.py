"""Nemotron-Labs-Diffusion (`model_type: nemotron_labs_diffusion`, NVIDIA's `NemotronLabsDiffusionModel`):
a Ministral-3 decoder (network.py) whose one head serves three decoding modes -- autoregressive,
block diffusion anchored at the prompt end, and LinearSpec self-speculation (a diffusion draft of a
block verified by one causal forward).

The engine serves it with seeded block decoding (engine.core.decoding.seeded_block): per request
(`dllm_mode`) autoregressively, by block diffusion anchored at the prompt end, or by LinearSpec; every
K/V it keeps is causal. The block length is the checkpoint's (config.json `block_size`, 32 in the
release). lora.py reads the release's LinearSpec draft adapter (`linear_spec_lora/`), which the network
runs on the rows a forward flags as drafts; the release's three loops are the testing kit's
(testing/references/nemotron_labs_diffusion.py).
"""

from __future__ import annotations

from configs.knobs import Paradigm
from engine.model.families.nemotron_labs_diffusion.config import nemotron_fields
from engine.model.families.nemotron_labs_diffusion.network import NemotronLabsDiffusionLM
from engine.model.family import ModelFamily

FAMILY = ModelFamily("nemotron_labs_diffusion", Paradigm.SEEDED_BLOCK, predicts_next=True,
                     block_length_keys=("block_size",), default_block_length=32,
                     config_fields=nemotron_fields, network=NemotronLabsDiffusionLM)
