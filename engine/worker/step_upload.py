"""A step's integer metadata onto the device in one copy.

Every list a forward needs (token ids, positions, cache slots, page tables, rows to sample, the
attention backend's planned arrays) is packed on the host into one int64 tensor and copied once.
On CUDA the host side is a persistent pinned buffer and the copy is non-blocking into a persistent
device buffer, so the host goes on to queue the forward while the copy runs; the arrays are views
of that device buffer. Before the pinned buffer is written again, the host waits for the event
recorded after the previous copy (it has long finished by then: it ran at the start of the
previous forward, which the overlap schedule may still be running).
"""

from __future__ import annotations

from itertools import chain

import torch


class StepUploader:
    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._for: torch.device | None = None  # the device the buffers were made for
        self._copied: torch.cuda.Event | None = None
        self.uploads = 0  # host->device copies made, for tests and profiles

    def upload(self, fields: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
        """`fields` as 1-D int64 tensors on `device`, in one host->device copy (none on the CPU)."""
        sizes = [len(values) for values in fields.values()]
        packed = torch.tensor(list(chain.from_iterable(fields.values())), dtype=torch.long)
        if device.type == "cpu":
            return dict(zip(fields, packed.split(sizes), strict=True))
        self.uploads += 1
        if not torch.cuda.is_available():  # a fake CUDA device (tests): no pinned memory, no events
            return dict(zip(fields, packed.to(device).split(sizes), strict=True))
        n = packed.numel()
        if self._host is None or self._host.numel() < n or self._for != device:
            size = max(n, 2 * (0 if self._host is None else self._host.numel()), 4096)
            self._host = torch.empty(size, dtype=torch.long, pin_memory=True)
            self._device = torch.empty(size, dtype=torch.long, device=device)
            self._for = device
        elif self._copied is not None:
            self._copied.synchronize()
        self._host[:n].copy_(packed)
        self._device[:n].copy_(self._host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return dict(zip(fields, self._device[:n].split(sizes), strict=True))
