"""What the model runner may ask of a network, declared rather than probed.

Every network has the `Network` surface. A few have more, and say so with a class flag the runner
reads once when it builds the network (as vLLM's `models/interfaces.py` does), so no call site finds
a capability with `hasattr`:

* `ChecksLoaded` (`checks_loaded = True`): checks across tensors once every weight is in;
* `FixesBlockLength` (`fixes_block_length = True`): refuses an engine block length its checkpoint
  does not decode in (LLaDA2.2's block routing);
* `LayerGroupNetwork` (`has_layer_groups = True`): layers in groups with their own K/V geometry and
  attention backend, run as encoder and canvas passes (engine.worker.layer_groups; DiffusionGemma).

`tests/engine/test_network_interfaces.py` checks every registered family against these declarations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn


@runtime_checkable
class Network(Protocol):
    """The surface the runner uses on every network: built on the meta device, materialised once,
    loaded through its parameters' weight loaders, then run forward and projected to logits."""

    @property
    def embed_tokens(self) -> nn.Module:
        """The input embedding (also the LM head's weight when a checkpoint ties them)."""
        ...

    def materialize(self, device: torch.device, dtype: torch.dtype) -> Network:
        """Allocate every parameter (uninitialised) in `dtype` on `device`."""
        ...

    def use_compiled_elementwise(self) -> Network:
        """Run the elementwise work through compiled fused kernels (ops.fused)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any,
                *backend: Any) -> torch.Tensor:
        """Final hidden states of every fed row."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits of the given hidden rows."""
        ...


class ChecksLoaded(Protocol):
    checks_loaded: ClassVar[bool]

    def check_loaded(self) -> None:
        """Raise naming what is wrong when the loaded tensors disagree with one another."""
        ...


class FixesBlockLength(Protocol):
    fixes_block_length: ClassVar[bool]

    def check_block_length(self, block_length: int | None) -> None:
        """Raise when the checkpoint cannot decode in blocks of `block_length`."""
        ...


class DraftAdapted(Protocol):
    has_draft_adapter: ClassVar[bool]

    def load_draft_lora(self, path: str | Path | None = None) -> None:
        """Load the checkpoint's draft adapter (self-speculation's drafts run it: `forward(..., draft_rows=)`)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any, backend: Any,
                draft_rows: torch.Tensor | None = None) -> torch.Tensor:
        ...


class LayerGroupNetwork(Protocol):
    has_layer_groups: ClassVar[bool]

    def kv_layout(self, page_size: int, tp_size: int) -> Any:
        """The page geometry of its layer groups (the runner sizes and allocates the caches by it)."""
        ...

    @staticmethod
    def attention_backend(spec: Any, name: str, device: torch.device) -> Any:
        """Its own attention backend for `EngineConfig.attention_backend`, chosen before the weights load."""
        ...

    def pass_metadata(self, *args: Any) -> Any:
        """The attention metadata of one forward of encoder / canvas passes."""
        ...

    def soft_embedding(self, processed_logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning input the next canvas pass reads."""
        ...


def checks_loaded(network: object) -> TypeGuard[ChecksLoaded]:
    return getattr(network, "checks_loaded", False) is True


def fixes_block_length(network: object) -> TypeGuard[FixesBlockLength]:
    return getattr(network, "fixes_block_length", False) is True


def has_draft_adapter(network: object) -> TypeGuard[DraftAdapted]:
    return getattr(network, "has_draft_adapter", False) is True


def has_layer_groups(network: object) -> TypeGuard[LayerGroupNetwork]:
    """`network` may be the class (before it is built) or an instance."""
    return getattr(network, "has_layer_groups", False) is True


CAPABILITIES = {  # flag -> (its protocol, the members a network declaring it must have)
    "checks_loaded": (ChecksLoaded, ("check_loaded",)),
    "fixes_block_length": (FixesBlockLength, ("check_block_length",)),
    "has_layer_groups": (LayerGroupNetwork, ("kv_layout", "attention_backend", "pass_metadata", "soft_embedding")),
}
