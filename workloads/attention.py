"""Scaled-dot-product attention FLOP/s, with the SDPA backend that ran as part of the result.

The same call runs at very different speeds depending on the backend torch dispatches to
(flash, memory-efficient, cuDNN, math), and which one is eligible depends on the device, dtype,
shapes and torch version; a number without its backend cannot be compared. So the backend is
chosen once, recorded as the run's kernel, and pinned with torch.nn.attention.sdpa_kernel for
every timed call, which guarantees the record matches what ran:

- CUDA: flash, efficient, cudnn, math are tried in that order with one untimed call each (before
  the manifest); the first that runs is used.
- CPU: torch._fused_sdp_choice, the function SDPA itself uses to dispatch, says which backend the
  unpinned call would take: FLASH_ATTENTION is the CPU flash kernel (the fused, tiled
  implementation in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), MATH the unfused
  reference. On the development machine (torch 2.13, AVX-512) it is flash for fp32, bf16, fp16.

FLOPs per call: 4*B*H*S*S*D for the two batched matmuls of a non-causal forward pass (QK^T and
PV, 2*S*S*D each per head); half of that with --causal, as is conventional (the masked half is
skipped by the fused kernels). Softmax is not counted. Where the minimum of iterations would not
fit the duration, the sequence is halved up to 5 times (workloads/calibration.py).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, ClassVar, Final

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from workloads import calibration
from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.workload import Request, Spec, Step, Workload

MIN_SEQ = 16
BACKEND_NAMES: Final = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
}
CUDA_PREFERENCE: Final = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)


class Attention(Workload):
    spec: ClassVar[Spec] = Spec(
        name="attention",
        version=2,
        unit="FLOP/s",
        work_unit="flop",
        precisions=("bf16", "fp16", "fp32"),
        optimizations=("eager",),
        default_duration=10.0,
        devices=("cpu", "cuda"),
    )
    max_shrink = 5  # the sequence: 1024 -> 32 on a CPU

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        (batch, heads, seq, head_dim, repeats), sizing = self._sizes()
        seq = max(MIN_SEQ, seq >> request.shrink)
        generator = torch.Generator(device=self.torch_device).manual_seed(0)
        self.q, self.k, self.v = (
            precisions.random_operand(
                request.precision,
                (batch, heads, seq, head_dim),
                device=self.torch_device,
                generator=generator,
            )
            for _ in range(3)
        )
        self.causal = request.causal
        self.repeats = repeats
        flop = 4 * batch * heads * seq * seq * head_dim * repeats
        self.flop = flop // 2 if self.causal else flop
        self.backend = self._choose_backend()
        self.kernel = BACKEND_NAMES[self.backend]
        shape = [batch, heads, seq, head_dim]
        self.shapes = {"q": shape, "k": shape, "v": shape}
        self.parameters = {
            "batch": batch,
            "heads": heads,
            "seq_len": seq,
            "head_dim": head_dim,
            "causal": self.causal,
            "repeats": repeats,
            **sizing,
        }

    def _sizes(self) -> tuple[tuple[int, int, int, int, int], dict[str, Any]]:
        """Batch, heads, sequence, head dimension and repeats; and what decided them, for the
        manifest's parameters."""
        if self.request.size == "small":
            return (1, 4, 256, 64, 1), {}
        if self.device.kind == "cuda":
            memory = calibration.memory_class(self.device)
            seq = 4096 if memory.name == "large" else 2048
            return (4, 16, seq, 128, 10), memory.parameters
        return (4, 8, 1024, 64, 1), {}

    def _attend(self) -> None:
        scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.causal)

    def _choose_backend(self) -> SDPBackend:
        if self.device.kind == "cpu":
            choice = torch._fused_sdp_choice(self.q, self.k, self.v, is_causal=self.causal)
            return SDPBackend(choice)
        for backend in CUDA_PREFERENCE:  # GPU-only: not exercised on CPU
            try:
                with sdpa_kernel(backend):
                    self._attend()
            except RuntimeError:
                continue  # not eligible for this dtype, shape or build: try the next one
            return backend
        raise RuntimeError("no SDPA backend runs these inputs")

    def steps(self) -> Generator[Step, None, None]:
        def attend() -> None:
            with sdpa_kernel(self.backend):
                for _ in range(self.repeats):
                    self._attend()

        while True:
            yield Step(work=self.flop, run=attend)
