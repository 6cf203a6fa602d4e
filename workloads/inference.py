"""A small decoder-only transformer, random weights, greedy decoding with a static KV cache.

It stands for the serving regime: prefill is compute-bound (many tokens per weight read), decode
is latency- and bandwidth-bound (one token per sequence per step). Each iteration is one phase:
a prefill of the whole prompt (work = batch * prompt tokens), then one decode step per generated
token (work = batch tokens). When the cache is full a new round starts with a new prefill.
Per-token latency is the duration of a decode step (every sequence gets one token per step).

Weights come from torch.manual_seed(0): nothing is downloaded, and every run computes the same.

The KV cache is static (preallocated for prompt + generated tokens, written with index_copy_,
read through a position mask), so decode steps all have one shape: eager and compiled run the
same model code, and torch.compile (dynamic=False) compiles exactly two graphs, prefill and
decode. They are compiled before the manifest (see Inference._compile), and the time each took
is reported in the manifest's parameters. A compiler that is missing or fails is an
`unsupported` outcome with its reason, as the README states.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend
from torch.nn.functional import gelu, scaled_dot_product_attention

from workloads import precision as precisions
from workloads.attention import BACKEND_NAMES
from workloads.device import DeviceInfo
from workloads.protocol import Unsupported
from workloads.workload import Record, Request, Spec, Step, Workload


@dataclass(frozen=True, slots=True)
class Shape:
    vocab: int
    d_model: int
    layers: int
    heads: int
    ffn: int
    batch: int
    prompt: int
    generate: int


SMALL = Shape(vocab=1024, d_model=256, layers=2, heads=4, ffn=1024, batch=2, prompt=32, generate=32)
CPU = Shape(vocab=8192, d_model=256, layers=4, heads=4, ffn=1024, batch=4, prompt=128, generate=128)
GPU = Shape(
    vocab=32000, d_model=512, layers=6, heads=8, ffn=2048, batch=16, prompt=512, generate=256
)


class Block(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, shape: Shape, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.d_model)
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=False)
        self.proj = nn.Linear(shape.d_model, shape.d_model, bias=False)
        self.norm2 = nn.LayerNorm(shape.d_model)
        self.up = nn.Linear(shape.d_model, shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.d_model, bias=False)
        self.register_buffer("k_cache", k_cache, persistent=False)
        self.register_buffer("v_cache", v_cache, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each batch x heads x tokens x head_dim
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        attended = scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        out: torch.Tensor = x + self.down(gelu(self.up(self.norm2(x))))
        return out


class Decoder(nn.Module):
    slots: torch.Tensor

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        length = shape.prompt + shape.generate
        head_dim = shape.d_model // shape.heads
        cache_shape = (shape.batch, shape.heads, length, head_dim)
        self.embed = nn.Embedding(shape.vocab, shape.d_model)
        self.position = nn.Embedding(length, shape.d_model)
        self.blocks = nn.ModuleList(
            Block(
                shape,
                torch.zeros(cache_shape, dtype=dtype, device=device),
                torch.zeros(cache_shape, dtype=dtype, device=device),
            )
            for _ in range(shape.layers)
        )
        self.norm = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        self.register_buffer("slots", torch.arange(length, device=device), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Greedy next token of each sequence after these tokens at these positions."""
        x = self.embed(tokens) + self.position(positions)
        mask = self.slots[None, :] <= positions[:, None]  # causal, and hides unwritten slots
        for block in self.blocks:
            x = block(x, positions, mask)
        logits: torch.Tensor = self.head(self.norm(x[:, -1]))
        return logits.argmax(dim=-1, keepdim=True)


class Inference(Workload):
    spec: ClassVar[Spec] = Spec(
        name="inference",
        version=1,
        unit="tokens/s",
        work_unit="token",
        precisions=("bf16", "fp16", "fp32"),
        optimizations=("eager", "compiled"),
        default_duration=10.0,
        devices=("cpu", "cuda"),
    )

    @classmethod
    def unsupported_reason(
        cls, device: DeviceInfo, precision: str, optimization: str
    ) -> str | None:
        reason = super().unsupported_reason(device, precision, optimization)
        if reason is None and optimization == "compiled":
            reason = compile_unsupported_reason(device)
        return reason

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        shape = self._shape()
        dtype = precisions.dtype(request.precision)
        dev = self.torch_device
        torch.manual_seed(0)
        model = Decoder(shape, dtype, dev).to(dtype=dtype, device=dev).eval()
        self.shape = shape
        self.prompt = torch.randint(shape.vocab, (shape.batch, shape.prompt), device=dev)
        self.prompt_positions = torch.arange(shape.prompt, device=dev)
        self.decode_positions = [
            torch.full((1,), shape.prompt + i, device=dev) for i in range(shape.generate)
        ]
        self.model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = model
        self.kernel = self._sdpa_backend(dtype)
        self.shapes = {"prompt": [shape.batch, shape.prompt], "decode": [shape.batch, 1]}
        self.parameters = {
            **asdict(shape),
            "weights": sum(p.numel() for p in model.parameters()),
            "kv_cache": "static",
            "sampling": "greedy",
        }
        if request.optimization == "compiled":
            self.model = torch.compile(model, dynamic=False)
            self.kernel = "inductor"
            self.parameters["compile"] = {
                "backend": "inductor",
                "mode": "default",
                "dynamic": False,
                "seconds": self._compile(),
            }

    def _compile(self) -> dict[str, float]:
        """Compile both graphs now, before the manifest, and say how long each took.

        On a cold inductor cache this takes tens of seconds on a CPU, longer than a probe's
        duration: inside the iterations it would leave a run with no decode steps at all. It is a
        one-off software cost, reported as such, not device warm-up. Shapes are static, so the
        timed iterations never compile again.
        """
        # Imported here: torch._dynamo costs a second of start-up that eager runs do not need.
        from torch._dynamo.exc import BackendCompilerFailed  # noqa: PLC0415

        seconds = {}
        try:
            began = time.perf_counter()
            tokens = self._call(self.prompt, self.prompt_positions)
            seconds["prefill"] = time.perf_counter() - began
            began = time.perf_counter()
            self._call(tokens, self.decode_positions[0])
            seconds["decode"] = time.perf_counter() - began
        except BackendCompilerFailed as exc:
            raise Unsupported(f"torch.compile failed: {str(exc).strip().splitlines()[0]}") from exc
        return seconds

    def _shape(self) -> Shape:
        if self.request.size == "small":
            return SMALL
        return GPU if self.device.kind == "cuda" else CPU

    def _sdpa_backend(self, dtype: torch.dtype) -> str:
        """The backend a decode step's attention dispatches to (eager; not pinned)."""
        shape, dev = self.shape, self.torch_device
        length, head_dim = shape.prompt + shape.generate, shape.d_model // shape.heads
        q = torch.zeros((shape.batch, shape.heads, 1, head_dim), dtype=dtype, device=dev)
        kv = torch.zeros((shape.batch, shape.heads, length, head_dim), dtype=dtype, device=dev)
        mask = torch.ones((1, length), dtype=torch.bool, device=dev)
        choice = torch._fused_sdp_choice(q, kv, kv, attn_mask=mask)
        return f"sdpa:{BACKEND_NAMES[SDPBackend(choice)]}"

    def steps(self) -> Generator[Step, None, None]:
        state: dict[str, torch.Tensor] = {}

        def prefill() -> None:
            state["next"] = self._call(self.prompt, self.prompt_positions)

        decodes = [self._decode_step(state, positions) for positions in self.decode_positions]
        prefill_tokens = self.shape.batch * self.shape.prompt
        while True:
            yield Step(work=prefill_tokens, run=prefill, phase="prefill")
            for decode in decodes:
                yield Step(work=self.shape.batch, run=decode, phase="decode")

    def _decode_step(
        self, state: dict[str, torch.Tensor], positions: torch.Tensor
    ) -> Callable[[], None]:
        def decode() -> None:
            state["next"] = self._call(state["next"], positions)

        return decode

    def _call(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(tokens, positions)

    def summary(self, records: Sequence[Record]) -> dict[str, Any]:
        def rate(phase: str) -> float | None:
            chosen = [r for r in records if r.phase == phase]
            seconds = sum(r.end - r.start for r in chosen)
            return sum(r.work for r in chosen) / seconds if seconds > 0 else None

        latencies = [r.end - r.start for r in records if r.phase == "decode"]
        return {
            "prefill_tokens_per_second": rate("prefill"),
            "decode_tokens_per_second": rate("decode"),
            "latency_seconds": percentiles(latencies),
        }

    def phase_summary(self, phase: str, records: Sequence[Record]) -> dict[str, Any]:
        """Decode's entry also carries the per-token latency (the top level's
        ``latency_seconds``), so that the phase states its own figures."""
        if phase != "decode":
            return {}
        return {"latency_seconds": percentiles([r.end - r.start for r in records])}


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p90, p99 (linear interpolation between order statistics); None without values."""
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def compile_unsupported_reason(device: DeviceInfo) -> str | None:
    """The cheap preconditions of torch.compile; a failure while compiling is caught as well."""
    # Imported here: torch._dynamo costs a second of start-up that eager runs do not need.
    from torch._dynamo.eval_frame import is_dynamo_supported  # noqa: PLC0415
    from torch._inductor import config  # noqa: PLC0415
    from torch.utils._triton import has_triton  # noqa: PLC0415

    if not is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python"
    if device.kind == "cpu":
        compiler = config.cpp.cxx[1]
        if shutil.which(compiler) is None:
            return f"torch.compile on CPU needs a C++ compiler; {compiler!r} was not found"
        return None
    if not has_triton():  # GPU-only: not exercised on CPU
        return "torch.compile on CUDA needs Triton, which is not installed"
    return None
