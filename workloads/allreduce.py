"""All-reduce bus bandwidth across the node's ranks, as nccl-tests reports it.

One rank per GPU over NCCL (every visible GPU: the agent makes them all visible for this
node-wide workload), or, with ``--ranks N`` on a CPU, N ranks over gloo (tests run the agent's
node-wide path this way; on a CPU-only node it measures the host's shared-memory path). It follows
the torch.distributed documentation:

- One process per rank. This process is rank 0 (cuda:0 on GPUs) and the one that speaks the
  protocol; ranks 1..n-1 are started with the multiprocessing "spawn" method (CUDA cannot be
  forked) and print nothing. They are this process's children, so the agent counts them as its
  own, never as foreign work. All join one process group through a TCP store on 127.0.0.1 at a
  free port.
- Every rank runs the same sequence per iteration: one tiny MAX all-reduce of a stop flag (rank 0
  sets it when its duration or iteration cap is reached, outside the timed window), then the
  timed all-reduce(s) of the payload. So all ranks do the same number of iterations and stop
  together.
- Work is counted in bus bytes, as nccl-tests defines them: algbw = bytes / time, and
  busbw = algbw * 2(n-1)/n, the per-link traffic of a ring all-reduce, comparable across node
  sizes. An iteration's work is bytes * 2(n-1)/n * repeats, so its throughput is the bus bandwidth.
- Message: 1/8 of the free memory of cuda:0, at most 1 GiB (16 MiB with --size small; 64 MiB on a
  CPU), repeated 5 times per iteration.
- Payload: ones, summed in place, so each all-reduce multiplies it by n. Every rank fills it with
  ones again between iterations, outside the timed window (rank 0 before its timer starts, the
  others before they agree to go on), so it never exceeds n^5 (32768 on 8 GPUs) however long the
  run; left to grow, fp32 and bf16 reach inf after 128/log2(n) sums (43 on 8 GPUs, 26 iterations
  on 2 CPU ranks). The timed calls are the same SUM all-reduces of the same bytes.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Generator
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist

from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.protocol import Unsupported
from workloads.workload import Request, Spec, Step, Workload

MAX_BYTES = 1 << 30
SMALL_BYTES = 16 << 20
CPU_BYTES = 64 << 20
REPEATS = 5
GROUP_TIMEOUT = timedelta(seconds=120)
JOIN_SECONDS = 60.0


class _Rank:
    """One rank's share: the process group, the payload, and the stop agreement."""

    def __init__(  # noqa: PLR0917 - one rank's whole description
        self, rank: int, world: int, port: int, precision: str, message_bytes: int, kind: str
    ) -> None:
        self.device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":  # GPU-only: not exercised on CPU
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend(kind),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=GROUP_TIMEOUT,
        )
        dtype = precisions.dtype(precision)
        element = torch.empty((), dtype=dtype).element_size()
        self.payload = torch.ones(message_bytes // element, dtype=dtype, device=self.device)
        self.bytes = self.payload.numel() * element
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)

    def reduce(self) -> None:
        for _ in range(REPEATS):
            dist.all_reduce(self.payload)

    def refill(self) -> None:
        """Between iterations: ones again, so that the sums stay finite."""
        self.payload.fill_(1)

    def agree_stop(self, stop: bool) -> bool:
        self.flag.fill_(int(stop))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return bool(self.flag.item())

    def close(self) -> None:
        dist.destroy_process_group()


def backend(kind: str) -> str:
    """NCCL between GPUs (GPU-only: not exercised on CPU), gloo between CPU ranks."""
    return "nccl" if kind == "cuda" else "gloo"


def _follow(  # noqa: PLR0917 - the rank's description, passed through spawn
    rank: int, world: int, port: int, precision: str, message_bytes: int, kind: str
) -> None:
    """Ranks 1..n-1: do what rank 0 does, until rank 0 says stop."""
    member = _Rank(rank, world, port, precision, message_bytes, kind)
    while not member.agree_stop(False):
        member.reduce()
        member.refill()
        if kind == "cuda":  # GPU-only: not exercised on CPU
            torch.cuda.synchronize(member.device)
    member.close()


def _free_port() -> int:
    """A port free now; the store binds it moments later (a race nccl-tests' launchers share)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Allreduce(Workload):
    spec: ClassVar[Spec] = Spec(
        name="allreduce",
        version=1,
        unit="B/s",
        work_unit="byte",
        precisions=("fp32", "bf16"),
        optimizations=("eager",),
        default_duration=10.0,
        devices=("cuda", "cpu"),
    )

    @classmethod
    def unsupported_reason(
        cls, device: DeviceInfo, precision: str, optimization: str
    ) -> str | None:
        if device.kind == "cpu":  # ranks over gloo, given --ranks (checked when built)
            return None if precision == "fp32" else "allreduce on CPU ranks is fp32 only"
        if device.cuda_device_count < 2:
            return f"allreduce needs 2 or more CUDA devices ({device.cuda_device_count} visible)"
        if device.torch_device != "cuda:0":  # GPU-only: not exercised on CPU
            return "allreduce is node-wide and runs rank 0 on cuda:0: use --device cuda:0"
        if not dist.is_nccl_available():  # GPU-only: not exercised on CPU
            return f"torch {torch.__version__} was built without NCCL"
        return super().unsupported_reason(device, precision, optimization)

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        if device.kind == "cuda":  # GPU-only: not exercised on CPU
            world = device.cuda_device_count
            largest = min((device.memory_free_bytes or 0) // 8, MAX_BYTES)
        elif request.ranks is None:
            raise Unsupported(
                "allreduce needs 2 or more CUDA devices (0 visible); on a CPU, --ranks N runs "
                "N ranks over gloo"
            )
        else:
            world, largest = request.ranks, CPU_BYTES
        message = SMALL_BYTES if request.size == "small" else largest
        port = _free_port()
        spawn = multiprocessing.get_context("spawn")
        self.followers = [
            spawn.Process(
                target=_follow,
                args=(rank, world, port, request.precision, message, device.kind),
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for follower in self.followers:
            follower.start()
        self.rank = _Rank(0, world, port, request.precision, message, device.kind)
        self.work = self.rank.bytes * 2 * (world - 1) / world * REPEATS
        self.shapes = {"payload": list(self.rank.payload.shape)}
        self.parameters = {
            "world_size": world,
            "bytes": self.rank.bytes,
            "repeats": REPEATS,
            "bus_factor": 2 * (world - 1) / world,
            "backend": backend(device.kind),
            "rank_pids": [follower.pid for follower in self.followers],
        }
        self.kernel = backend(device.kind)

    def steps(self) -> Generator[Step, None, None]:
        while True:
            yield Step(work=self.work, run=self.rank.reduce)
            self.rank.refill()

    def agree_stop(self, stop: bool) -> bool:
        return self.rank.agree_stop(stop)

    def close(self) -> None:
        self.rank.close()
        for follower in self.followers:
            follower.join(JOIN_SECONDS)
        failed = [f"{f.name}: exit code {f.exitcode}" for f in self.followers if f.exitcode != 0]
        if failed:
            raise RuntimeError(f"allreduce ranks failed: {', '.join(failed)}")
