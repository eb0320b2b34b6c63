"""Every registered family's network against the declared interfaces (engine.model.interfaces): the
surface every network has, and a capability flag set exactly where the network has that capability's
members -- so the runner, which reads only the flags, misses nothing a network can do and calls
nothing it cannot."""

from __future__ import annotations

import pytest

from engine.model.families import FAMILIES
from engine.model.interfaces import CAPABILITIES, Network

NETWORK_SURFACE = ("embed_tokens", "materialize", "use_compiled_elementwise", "forward", "logits")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_capability_flags_match_the_members(model_type):
    network = FAMILIES[model_type].network
    for flag, (_, members) in CAPABILITIES.items():
        declared = getattr(network, flag, False) is True
        has = [hasattr(network, m) for m in members]
        assert declared == all(has) and (declared or not any(has)), (model_type, flag, dict(zip(members, has)))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_network_has_the_surface_the_runner_uses(model_type):
    network = FAMILIES[model_type].network
    assert all(hasattr(network, name) for name in NETWORK_SURFACE), model_type
    assert all(hasattr(Network, name) for name in NETWORK_SURFACE), "the protocol declares what the runner uses"


def test_the_families_with_capabilities():
    """The capabilities as the families declare them today (a new one shows up here to be looked at)."""
    declared = {flag: sorted(t for t, f in FAMILIES.items() if getattr(f.network, flag, False))
                for flag in CAPABILITIES}
    assert declared == {"checks_loaded": ["diffusion_gemma"], "fixes_block_length": ["llada2_moe"],
                        "has_layer_groups": ["diffusion_gemma"]}
