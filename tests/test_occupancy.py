"""Who was running on each device: a real gRPC kubelet on a unix socket, a procfs tree of Slurm
tasks, and the agent end to end on the fake driver."""

from __future__ import annotations

import os
import shutil
import socket as socket_module
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import fetch, start_agent
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector as PromCollector

from agent.config.archive_section import OccupancySection
from agent.exporter.occupancy import occupancy_families
from agent.occupancy.podresources import (
    SERVICE,
    Allocation,
    PodResourcesClient,
    PodResourcesWatch,
    messages,
)
from agent.occupancy.slurm import SlurmJobs
from agent.occupancy.tracker import Occupancy, Occupant
from collectors.base import Event, Reading, Sample

SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
GPU0 = "GPU-7d3ab3a4-1c2e-4f1e-9b1a-2a8f5c3e6d01"  # two_gpus.scn
GPU1 = "GPU-2b9e41c7-88d0-4a6b-b3f2-91c04e7a5d02"
MIG = "MIG-11111111-1111-4111-8111-111111111111"

Pod = tuple[str, str, str, str, Sequence[str]]  # namespace, pod, container, resource, ids


class Kubelet:
    """A gRPC server answering v1.PodResourcesLister/List as the kubelet does; counts calls."""

    def __init__(self, socket: Path, pods: Sequence[Pod], delay_seconds: float = 0.0) -> None:
        self.socket = socket
        self.calls = 0
        self._lock = threading.Lock()
        kinds = messages()
        self.response = kinds.response()
        for namespace, name, container, resource, ids in pods:
            pod = self.response.pod_resources.add(name=name, namespace=namespace)
            held = pod.containers.add(name=container)
            held.cpu_ids.extend([2, 3])
            devices = held.devices.add(resource_name=resource)
            devices.device_ids.extend(ids)
            devices.topology.nodes.add(ID=0)

        self._stopping = threading.Event()

        def list_pods(request: Any, context: Any) -> Any:
            with self._lock:
                self.calls += 1
            self._stopping.wait(delay_seconds)  # a delayed answer, cut short by stop()
            return self.response

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    list_pods,
                    request_deserializer=kinds.request.FromString,
                    response_serializer=kinds.response.SerializeToString,
                )
            },
        )
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop(grace=None).wait()
        self.socket.unlink(missing_ok=True)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory: a unix socket's path is limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="kubelet-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def gpu_sample(index: int, uuid: str, pids: tuple[int, ...] = (), parent: str = "") -> Sample:
    labels: tuple[tuple[str, str], ...] = (("device", str(index)), ("uuid", uuid))
    if parent:
        labels = (*labels, ("parent", parent), ("mig_instance", "1"))
    readings = (Reading("gpu_power_watts", 100.0, labels),)
    return Sample("nvml", uuid, time.time(), readings, foreign_pids=pids)


# --------------------------------------------------------------------------------------------
# The PodResources client and its background watch
# --------------------------------------------------------------------------------------------


def test_the_client_reads_every_container_device(socket_dir: Path) -> None:
    pods: list[Pod] = [
        ("ml", "train-0", "main", "nvidia.com/gpu", [GPU0, GPU1]),
        ("ml", "infer-1", "server", "nvidia.com/mig-1g.10gb", [MIG]),
    ]
    kubelet = Kubelet(socket_dir / "kubelet.sock", pods)
    try:
        found = PodResourcesClient(kubelet.socket, 5.0).list()
    finally:
        kubelet.stop()
    assert found == (
        Allocation("ml", "train-0", "main", "nvidia.com/gpu", GPU0),
        Allocation("ml", "train-0", "main", "nvidia.com/gpu", GPU1),
        Allocation("ml", "infer-1", "server", "nvidia.com/mig-1g.10gb", MIG),
    )
    assert kubelet.calls == 1


def test_the_watch_counts_outcomes_and_drops_a_stale_answer(socket_dir: Path) -> None:
    socket = socket_dir / "kubelet.sock"
    now = [100.0]
    watch = PodResourcesWatch(socket, 10.0, 1.0, clock=lambda: now[0])
    watch.poll_once()
    assert watch.requests() == {"no_socket": 1}
    assert watch.allocations() == ()
    assert watch.last_success is None

    kubelet = Kubelet(socket, [("ml", "train-0", "main", "nvidia.com/gpu", [GPU1])])
    watch.poll_once()
    assert [a.device_id for a in watch.allocations()] == [GPU1]
    assert watch.last_success is not None

    kubelet.stop()  # the server removes its socket
    watch.poll_once()
    assert watch.requests() == {"no_socket": 2, "ok": 1}
    with socket_module.socket(socket_module.AF_UNIX) as dead:
        dead.bind(str(socket))  # a socket file nobody listens on
        watch.poll_once()
    assert watch.requests() == {"no_socket": 2, "ok": 1, "unavailable": 1}
    now[0] += 30.0  # three intervals: still kept
    assert len(watch.allocations()) == 1
    now[0] += 0.5
    assert watch.allocations() == ()


def test_a_slow_kubelet_times_out(socket_dir: Path) -> None:
    kubelet = Kubelet(socket_dir / "kubelet.sock", [], delay_seconds=2.0)
    watch = PodResourcesWatch(kubelet.socket, 10.0, 0.2)
    try:
        watch.poll_once()
    finally:
        kubelet.stop()
    assert watch.requests() == {"timeout": 1}


def test_stop_ends_a_call_in_flight_within_a_second(socket_dir: Path) -> None:
    """The call in flight is cancelled, not waited for: stop() gives the thread a second, and
    the thread ends long before the kubelet's answer (in 60 s) would have come. How long the
    thread takes to wind up after the cancel is a loaded machine's to stretch, so it is given
    time to end, and the bound is the answer's delay, not the second."""
    delay = 60.0
    kubelet = Kubelet(socket_dir / "kubelet.sock", [], delay_seconds=delay)
    watch = PodResourcesWatch(kubelet.socket, 30.0, 60.0)
    try:
        watch.start()
        deadline = time.monotonic() + 60
        while kubelet.calls == 0:
            assert time.monotonic() < deadline, "the watch never called the kubelet"
            time.sleep(0.01)
        started = time.monotonic()
        watch.stop()
        assert time.monotonic() - started < delay / 3  # stop() waits a second at the most
        assert watch._thread is not None
        watch._thread.join(delay / 3)
        assert not watch._thread.is_alive()
        assert time.monotonic() - started < delay / 3, "the call in flight was waited for"
    finally:
        kubelet.stop()


# --------------------------------------------------------------------------------------------
# Slurm jobs from a procfs tree
# --------------------------------------------------------------------------------------------


def write_process(
    procfs: Path, pid: int, started: int, cgroup: str = "", environ: bytes | None = None
) -> None:
    directory = procfs / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    # The command name may hold spaces and parentheses; start time is field 22.
    after = ["S", "1", str(pid), str(pid), "0", "-1", "4194304"] + ["0"] * 12 + [str(started)]
    (directory / "stat").write_text(f"{pid} (python (rank 0)) {' '.join(after)} 0 0\n")
    (directory / "cgroup").write_text(cgroup)
    if environ is not None:
        (directory / "environ").write_bytes(environ)


@pytest.fixture
def slurm_procfs(tmp_path: Path) -> Path:
    procfs = tmp_path / "proc"
    write_process(
        procfs,
        101,
        5000,
        "12:memory:/slurm/uid_1000/job_4242/step_0/task_0\n"
        "4:devices:/slurm/uid_1000/job_4242/step_0/task_0\n",
    )
    write_process(
        procfs, 102, 5001, "0::/system.slice/slurmstepd.scope/job_4343/step_0/user/task_0\n"
    )
    write_process(
        procfs, 103, 5002, "0::/user.slice/user-1000.slice\n", b"HOME=/home/a\0SLURM_JOB_ID=77\0"
    )
    write_process(procfs, 104, 5003, "0::/user.slice\n", b"HOME=/root\0")  # not a Slurm task
    write_process(procfs, 105, 5004, "0::/user.slice\n", b"")
    environ = procfs / "105" / "environ"
    if os.geteuid() == 0:  # root reads any mode; a directory fails the read the same way
        environ.unlink()
        environ.mkdir()
    else:
        environ.chmod(0)
    return procfs


def test_slurm_jobs_from_cgroups_and_environment(slurm_procfs: Path) -> None:
    jobs = SlurmJobs(slurm_procfs)
    assert [jobs.job_of(pid) for pid in (101, 102, 103, 104, 105, 999)] == [
        "4242",
        "4343",
        "77",
        None,
        None,  # another user's environment: unknown
        None,  # gone
    ]
    assert len(jobs) == 5


def test_a_reused_pid_is_read_again(slurm_procfs: Path) -> None:
    jobs = SlurmJobs(slurm_procfs)
    assert jobs.job_of(101) == "4242"
    # The same process: the answer is the cached one (nothing is read again).
    (slurm_procfs / "101" / "cgroup").write_text("0::/slurm/job_1/step_0\n")
    assert jobs.job_of(101) == "4242"
    # Another process under the same pid: a new start time.
    write_process(slurm_procfs, 101, 9000, "0::/system.slice/slurmstepd.scope/job_5151/step_0\n")
    assert jobs.job_of(101) == "5151"
    jobs.keep_only({102})
    assert len(jobs) == 0
    assert jobs.job_of(102) == "4343"
    assert len(jobs) == 1


def test_the_tracker_names_the_slurm_jobs_on_a_gpu(slurm_procfs: Path, socket_dir: Path) -> None:
    settings = OccupancySection(pod_resources_socket=socket_dir / "absent.sock")
    occupancy = Occupancy(settings, slurm_procfs)
    occupancy.record(Sample("host", "host", time.time(), (Reading("load1", 0.5),)))
    occupancy.record(gpu_sample(0, GPU0, (101, 103, 104)))
    occupancy.record(gpu_sample(1, GPU1, (102,)))
    assert occupancy.occupants(GPU0) == (Occupant(slurm_job="4242"), Occupant(slurm_job="77"))
    assert occupancy.occupants(GPU1)[0].describe() == "slurm job 4343"
    assert occupancy.occupants("host") == ()
    occupancy.record(gpu_sample(0, GPU0, ()))  # the jobs on GPU 0 ended
    assert occupancy.occupants(GPU0) == ()
    assert occupancy.slurm is not None
    assert len(occupancy.slurm) == 1  # 102 only

    off = Occupancy(
        OccupancySection(pod_resources_socket=settings.pod_resources_socket, slurm=False),
        slurm_procfs,
    )
    off.record(gpu_sample(1, GPU1, (102,)))
    assert off.occupants(GPU1) == ()


# --------------------------------------------------------------------------------------------
# Pods on devices, events enriched
# --------------------------------------------------------------------------------------------


def test_pods_are_mapped_to_devices_and_events_name_them(
    socket_dir: Path, slurm_procfs: Path
) -> None:
    pods: list[Pod] = [
        ("ml", "train-0", "main", "nvidia.com/gpu", [GPU1]),
        ("ml", "infer-1", "server", "nvidia.com/mig-1g.10gb", [MIG]),
        ("batch", "by-index", "c", "nvidia.com/gpu", ["0"]),
        ("shared", "slice-a", "c", "nvidia.com/gpu", [f"{GPU1}::2"]),
        ("other", "ghost", "c", "nvidia.com/gpu", ["GPU-unknown", "7"]),
    ]
    kubelet = Kubelet(socket_dir / "kubelet.sock", pods)
    occupancy = Occupancy(OccupancySection(pod_resources_socket=kubelet.socket), slurm_procfs)
    try:
        occupancy.record(gpu_sample(0, GPU0, (101,)))
        occupancy.record(gpu_sample(1, GPU1, (102,)))
        occupancy.record(gpu_sample(2, "GPU-parent", ()))
        occupancy.record(gpu_sample(2, MIG, (), parent="GPU-parent"))
        occupancy.watch.poll_once()
    finally:
        kubelet.stop()
    train = Occupant("ml", "train-0", "main")
    assert occupancy.occupants(GPU1) == (train, Occupant("shared", "slice-a", "c"))
    assert occupancy.occupants(GPU0) == (Occupant("batch", "by-index", "c"),)  # not Slurm's
    assert occupancy.occupants("GPU-parent") == (Occupant("ml", "infer-1", "server"),)
    assert train.describe() == "pod ml/train-0 container main"
    assert occupancy.status().pods == [
        ("0", GPU0, "batch", "by-index", "c"),
        ("1", GPU1, "ml", "train-0", "main"),
        ("1", GPU1, "shared", "slice-a", "c"),
        ("2", MIG, "ml", "infer-1", "server"),
    ]

    xid = Event("xid", GPU1, time.time(), "GPU 1: XID 79", (("xid", "79"),))
    lonely = Event("xid", "GPU-nobody", time.time(), "GPU 9: XID 79", (("xid", "79"),))
    sample = Sample("nvml", "system", time.time(), (), events=(xid, lonely))
    enriched = occupancy.enrich(sample)
    first, second = enriched.events
    assert (first.id, first.kind, first.message) == (xid.id, xid.kind, xid.message)
    assert first.attributes == (
        ("xid", "79"),
        ("pod", "ml/train-0,shared/slice-a"),
        ("container", "main,c"),
    )
    assert second is lonely
    quiet = Sample("nvml", GPU1, time.time(), ())
    assert occupancy.enrich(quiet) is quiet
    assert occupancy.enrich(Sample("nvml", "system", time.time(), (), events=(lonely,))).events == (
        lonely,
    )


class _Status(PromCollector):
    def __init__(self, occupancy: Occupancy) -> None:
        self.occupancy = occupancy

    def collect(self) -> Iterator[Any]:
        yield from occupancy_families(self.occupancy.status())


def test_the_exposition_of_pods_and_requests(socket_dir: Path, tmp_path: Path) -> None:
    kubelet = Kubelet(socket_dir / "kubelet.sock", [("ml", "train-0", "main", "x", [GPU1])])
    occupancy = Occupancy(OccupancySection(pod_resources_socket=kubelet.socket), tmp_path)
    try:
        occupancy.record(gpu_sample(1, GPU1))
        occupancy.watch.poll_once()
    finally:
        kubelet.stop()
    occupancy.watch.poll_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Status(occupancy))
    text = generate_latest(registry).decode()
    assert (
        'sustain_device_pod_info{container="main",device="1",namespace="ml",pod="train-0",'
        f'uuid="{GPU1}"}} 1.0'
    ) in text
    assert 'sustain_podresources_requests_total{outcome="ok"} 1.0' in text
    assert 'sustain_podresources_requests_total{outcome="no_socket"} 1.0' in text
    assert "sustain_podresources_last_success_timestamp_seconds " in text


# --------------------------------------------------------------------------------------------
# The agent end to end
# --------------------------------------------------------------------------------------------


def pod_info(body: str) -> list[dict[str, str]]:
    return [
        sample.labels
        for family in text_string_to_metric_families(body)
        if family.name == "sustain_device_pod_info"
        for sample in family.samples
        if sample.value == 1.0
    ]


def requests(body: str) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(body)
        if family.name == "sustain_podresources_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_the_agent_names_the_pod_on_each_gpu(
    fake_nvml: Path, tmp_path: Path, socket_dir: Path
) -> None:
    """The acceptance: the pod on GPU 1 appears, goes three intervals after the kubelet does,
    comes back with it, and 200 scrapes a second never reach the kubelet."""
    socket = socket_dir / "kubelet.sock"
    interval = 2.0
    config = tmp_path / "sustain.toml"
    config.write_text(
        f'[occupancy]\npod_resources_socket = "{socket}"\n'
        f"pod_resources_interval_seconds = {interval}\n\n[probing]\nenabled = false\n"
    )
    pods: list[Pod] = [
        ("ml", "train-0", "main", "nvidia.com/gpu", [GPU1]),
        ("other", "ghost", "c", "nvidia.com/gpu", ["GPU-00000000-dead-beef-0000-000000000000"]),
    ]
    kubelet = Kubelet(socket, pods)
    running = start_agent(
        tmp_path,
        "--config",
        str(config),
        env={
            "LD_LIBRARY_PATH": str(fake_nvml.parent),
            "FAKENVML_SCENARIO": str(SCENARIOS / "two_gpus.scn"),
        },
    )
    try:
        body = running.wait_for("sustain_device_pod_info{", timeout=120)
        line = (  # the exporter sorts the labels
            'sustain_device_pod_info{container="main",device="1",namespace="ml",pod="train-0",'
            f'uuid="{GPU1}"}} 1.0'
        )
        assert line in body.splitlines()
        assert pod_info(body) == [
            {"device": "1", "uuid": GPU1, "namespace": "ml", "pod": "train-0", "container": "main"}
        ]

        kubelet.stop()
        gone_at = time.monotonic()
        deadline = gone_at + 5 * interval + 60
        while pod_info(body) and time.monotonic() < deadline:
            time.sleep(0.5)
            status, body = fetch(running.base + "/metrics")
            assert status == 200
        assert pod_info(body) == [], "the pod outlived the kubelet's answers"
        # Kept for three intervals after the last answer (which came up to one interval before).
        assert time.monotonic() - gone_at >= 2 * interval
        assert requests(body).get("no_socket", 0) >= 2

        kubelet = Kubelet(socket, pods[:1])
        back = time.monotonic()
        body = running.wait_for('pod="train-0"', timeout=3 * interval + 60)
        # Read at the watch's next poll (one interval), seen here within the slack a loaded
        # machine's scrapes need; a watch that backed off would take several intervals more.
        assert time.monotonic() - back <= 2 * interval + 10

        # 2000 scrapes at up to 200 a second (10 s unloaded; longer when the agent answers
        # slower): the kubelet is asked once an interval whatever the scrapes.
        outcomes = scrape_hard(running.base + "/metrics", count=2000, rate=200.0, threads=8)
        elapsed = time.monotonic() - back
        assert outcomes == {"ok": 2000, "failed": 0}, outcomes
        assert kubelet.calls <= elapsed / interval + 1, (kubelet.calls, elapsed)
    finally:
        code, _, err = running.terminate()
        kubelet.stop()
    assert code == 0, err


def scrape_hard(url: str, count: int, rate: float, threads: int) -> dict[str, int]:
    """``count`` scrapes at ``rate`` requests per second at the most, from several threads (each
    given 30 s to be answered: a loaded machine's slow answer is no failed scrape)."""
    outcomes = {"ok": 0, "failed": 0}
    lock = threading.Lock()
    period = threads / rate
    left = [count]

    def worker(offset: float) -> None:
        due = time.monotonic() + offset
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            time.sleep(max(0.0, due - time.monotonic()))
            due += period
            try:
                status, _ = fetch(url, timeout=30)
            except OSError:
                status = 0
            with lock:
                outcomes["ok" if status == 200 else "failed"] += 1

    workers = [
        threading.Thread(target=worker, args=(i * period / threads,)) for i in range(threads)
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return outcomes
