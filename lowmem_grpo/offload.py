"""Activation offload (train.offload_activations): checkpointed layer inputs wait in host memory.

With gradient checkpointing, what a decoder keeps on the device from its forward to its backward is each
layer's input, [tokens x hidden] per layer (docs/algorithm.md §22). torch.utils.checkpoint stores those
inputs through autograd's saved-tensor mechanism, so a `saved_tensors_hooks` context around the policy's
forward sees them: `pack` copies each one into pinned host memory on a side stream, and the device tensor is
dropped once a later pack has made the compute stream wait for that copy; `unpack` brings it back when
backward reaches that layer. Activations inside a checkpointed layer never reach these hooks (checkpoint's
own hooks take them first), and parameters are never copied: they live on the device anyway.

On a CPU every tensor is already in host memory: the hooks pass it through untouched, so a CPU run is the
same run with or without offload (tests/test_offload.py checks gradients equal, and checks the copy path by
forcing it with `copy_host_tensors`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

MIN_OFFLOAD_BYTES = 1 << 20   # smaller saved tensors (masks, norms' statistics) are not worth a transfer
MAX_IN_FLIGHT = 1  # device tensors held for their copy to host: the current layer input (docs/algorithm.md §22)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it that live on an accelerator, are not parameters and
    hold at least `min_bytes` go to pinned host memory until backward needs them.

    `copy_host_tensors` (tests): copy CPU tensors too, through the same path, so a CPU test exercises what a GPU
    run does (a fresh host buffer per tensor, the round trip in backward). `offloaded_bytes` counts what went."""

    def __init__(self, model: torch.nn.Module, min_bytes: int = MIN_OFFLOAD_BYTES, copy_host_tensors: bool = False):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.min_bytes, self.copy_host_tensors = min_bytes, copy_host_tensors
        self.offloaded_bytes, self.offloaded_tensors = 0, 0
        self.stream: Optional[torch.cuda.Stream] = None
        self.in_flight: deque = deque()   # (device tensor, the copy's CUDA event or None), oldest first
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "ActivationOffload":
        super().__enter__()
        return self

    def __exit__(self, *exc):
        while self.in_flight:  # the forward is over: nothing it made stays on the device on our account
            self._release_oldest()
        return super().__exit__(*exc)

    def _wanted(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu" and not self.copy_host_tensors:
            return False
        if t.numel() * t.element_size() < self.min_bytes or t.layout != torch.strided:
            return False
        return t.untyped_storage().data_ptr() not in self.params

    def _pack(self, t: torch.Tensor):
        if not self._wanted(t):
            return t
        self.offloaded_bytes += t.numel() * t.element_size()
        self.offloaded_tensors += 1
        if t.device.type != "cuda":  # CPU (tests): the same round trip and bookkeeping, with nothing to wait for
            self._hold_until_copied(t, None)
            return t.device, t.detach().clone(memory_format=torch.contiguous_format)
        # The copy runs on a side stream once the forward's work on t is done, so the forward does not wait for it.
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        self._hold_until_copied(t, self.stream.record_event())
        return t.device, host

    def _hold_until_copied(self, t: torch.Tensor, copied: Optional["torch.cuda.Event"]) -> None:
        """t's block must not be reused before the copy has read it. We hold t rather than `record_stream` it: a
        block under record_stream is freed only when the allocator next finds the copy finished, and when the
        copies are slower than the layers (small layers, PCIe-bound) that is many layers late, all of them
        counted at the peak (the likely cause of the 24-layer test's shortfall, docs/benchmarks.md). Holding at
        most MAX_IN_FLIGHT, and making the compute stream wait for the oldest copy before dropping it, bounds
        what the forward keeps whatever the copies' speed; at worst the forward runs at the copies' speed."""
        self.in_flight.append((t, copied))
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self._release_oldest()

    def _release_oldest(self) -> None:
        t, copied = self.in_flight.popleft()
        if copied is not None:
            # Work queued after this on the compute stream, including whatever the allocator gives t's block to
            # next, runs after the copy: so t can be dropped now, and its memory counts as free at once.
            torch.cuda.current_stream(t.device).wait_event(copied)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        if device.type != "cuda":
            return host
        torch.cuda.current_stream(device).wait_stream(self.stream)  # the forward's copy to host is complete
        return host.to(device, non_blocking=True)
