"""The kubelet's PodResources API v1: which container of which pod holds which device.

The kubelet serves ``v1.PodResourcesLister/List`` on a unix socket (by default
/var/lib/kubelet/pod-resources/kubelet.sock). Its answer names, for every container, the device
ids the device plugins allocated to it: GPU and MIG UUIDs from NVIDIA's plugin
(``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``, ...), sometimes GPU indices.

gRPC is spoken with grpcio, the reference implementation. The six messages needed are declared
below as a ``FileDescriptorProto`` and turned into classes by protobuf at run time: no protoc
step, no generated code to vendor and keep in step with the installed protobuf. Unknown fields
of newer kubelets (memory, dynamic resources) are skipped by the parser. Both packages are
imported only when a socket exists, so a node without Kubernetes never loads them, and a node
without the ``kubernetes`` extra logs that once and carries on without pod information.

A ``PodResourcesWatch`` asks in the background at most once per interval (never per scrape),
counts each answer by outcome, and keeps the last good answer for at most three intervals: pods
come and go, and a stale answer would name the wrong one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVICE = "v1.PodResourcesLister"
LIST_METHOD = f"/{SERVICE}/List"
STALE_INTERVALS = 3  # the last good answer is dropped this many intervals after it came

# (message, ((field, number, type, label, message type of a message field), ...))
_STRING, _INT64, _MESSAGE = "TYPE_STRING", "TYPE_INT64", "TYPE_MESSAGE"
_ONE, _MANY = "LABEL_OPTIONAL", "LABEL_REPEATED"
_MESSAGES: tuple[tuple[str, tuple[tuple[str, int, str, str, str], ...]], ...] = (
    ("ListPodResourcesRequest", ()),
    ("ListPodResourcesResponse", (("pod_resources", 1, _MESSAGE, _MANY, "PodResources"),)),
    (
        "PodResources",
        (
            ("name", 1, _STRING, _ONE, ""),
            ("namespace", 2, _STRING, _ONE, ""),
            ("containers", 3, _MESSAGE, _MANY, "ContainerResources"),
        ),
    ),
    (
        "ContainerResources",
        (
            ("name", 1, _STRING, _ONE, ""),
            ("devices", 2, _MESSAGE, _MANY, "ContainerDevices"),
            ("cpu_ids", 3, _INT64, _MANY, ""),
        ),
    ),
    (
        "ContainerDevices",
        (
            ("resource_name", 1, _STRING, _ONE, ""),
            ("device_ids", 2, _STRING, _MANY, ""),
            ("topology", 3, _MESSAGE, _ONE, "TopologyInfo"),
        ),
    ),
    ("TopologyInfo", (("nodes", 1, _MESSAGE, _MANY, "NUMANode"),)),
    ("NUMANode", (("ID", 1, _INT64, _ONE, ""),)),
)


@dataclass(frozen=True, slots=True)
class Messages:
    """The request and response classes of ``List`` (protobuf message classes)."""

    request: Any
    response: Any


@cache
def messages() -> Messages:
    """Build the message classes of kubelet's api.proto (package v1) in a private pool.

    Raises ImportError without protobuf."""
    from google.protobuf import (  # noqa: PLC0415 - only where a socket exists
        descriptor_pb2,
        descriptor_pool,
        message_factory,
    )

    proto = descriptor_pb2.FileDescriptorProto(
        name="sustain/podresources/v1/api.proto", package="v1", syntax="proto3"
    )
    field_type = descriptor_pb2.FieldDescriptorProto.Type
    field_label = descriptor_pb2.FieldDescriptorProto.Label
    for name, fields in _MESSAGES:
        message = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = message.field.add(
                name=field_name,
                number=number,
                type=field_type.Value(kind),
                label=field_label.Value(label),
                json_name=field_name,
            )
            if type_name:
                field.type_name = f".v1.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)

    def build(name: str) -> Any:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))

    return Messages(build("ListPodResourcesRequest"), build("ListPodResourcesResponse"))


@dataclass(frozen=True, slots=True)
class Allocation:
    """One device id the kubelet allocated to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


def allocations(response: Any) -> tuple[Allocation, ...]:
    """Flatten a ``ListPodResourcesResponse`` into one row per device id."""
    return tuple(
        Allocation(pod.namespace, pod.name, container.name, devices.resource_name, device_id)
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        for device_id in devices.device_ids
    )


class ListFailed(Exception):
    """A List call got no answer; ``outcome`` says why (a label value of the requests counter)."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def _outcome(code: Any) -> str:
    import grpc  # noqa: PLC0415 - only where a socket exists

    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return "error"


class PodResourcesClient:
    """One ``List`` call per ``list()``, each on a fresh channel: at most one call per interval,
    and a kubelet restarted on the same path is reached at once, without the channel's
    reconnection backoff."""

    def __init__(self, socket: Path, timeout_seconds: float) -> None:
        self.socket = socket
        self.timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._channel: Any = None
        self._closed = False

    def list(self) -> tuple[Allocation, ...]:
        """Raises ``ListFailed``, and ImportError where grpcio or protobuf is not installed."""
        import grpc  # noqa: PLC0415 - only where a socket exists

        kinds = messages()
        with self._lock:
            if self._closed:
                raise ListFailed("error", "the client is closed")
            channel = self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        try:
            call = channel.unary_unary(
                LIST_METHOD,
                request_serializer=kinds.request.SerializeToString,
                response_deserializer=kinds.response.FromString,
            )
            response = call(kinds.request(), timeout=self.timeout_seconds)
        except grpc.RpcError as exc:
            code = exc.code()  # the errors of a call are also Call objects
            details = exc.details()
            raise ListFailed(_outcome(code), f"{code.name}: {details}") from None
        finally:
            with self._lock:
                self._channel = None
            channel.close()
        return allocations(response)

    def close(self) -> None:
        """Cancel a call in flight (closing its channel ends it at once); no call after this."""
        with self._lock:
            self._closed = True
            channel = self._channel
        if channel is not None:
            channel.close()


class PodResourcesWatch:
    """Asks the kubelet in a background thread at most once per interval.

    A missing socket is asked about again each interval (the kubelet may start after the agent);
    each kind of failure is logged once until the next answer, and counted every time."""

    def __init__(
        self,
        socket: Path,
        interval_seconds: float,
        timeout_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket = socket
        self.interval_seconds = interval_seconds
        self._client = PodResourcesClient(socket, timeout_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._allocations: tuple[Allocation, ...] = ()
        self._answered_at: float | None = None  # clock() of the last good answer
        self._last_success: float | None = None  # Unix time of the same
        self._requests: Counter[str] = Counter()
        self._logged: set[str] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="podresources", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._client.close()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            self.poll_once()
            elapsed = self._clock() - started
            self._stop.wait(max(0.0, self.interval_seconds - elapsed))

    def poll_once(self) -> None:
        """Ask once and record the outcome."""
        if not self.socket.exists():
            self._failed("no_socket", f"no kubelet PodResources socket at {self.socket}")
            return
        try:
            found = self._client.list()
        except ImportError as exc:
            self._failed("no_grpc", f"PodResources: {exc}; install the kubernetes extra")
            return
        except ListFailed as exc:
            self._failed(exc.outcome, f"PodResources List on {self.socket} failed: {exc}")
            return
        with self._lock:
            self._requests["ok"] += 1
            self._allocations = found
            self._answered_at = self._clock()
            self._last_success = time.time()
            recovered, self._logged = bool(self._logged - {"no_socket"}), set()
        if recovered:
            log.info("the kubelet's PodResources API answers again (%d devices held)", len(found))

    def _failed(self, outcome: str, message: str) -> None:
        with self._lock:
            self._requests[outcome] += 1
            first = outcome not in self._logged
            self._logged.add(outcome)
        if first:
            if outcome == "no_socket":
                log.info("%s: no pod information until it appears", message)
            else:
                log.warning("%s (logged once until it answers again)", message)

    def allocations(self) -> tuple[Allocation, ...]:
        """The last good answer, or nothing once it is older than three intervals."""
        with self._lock:
            answered = self._answered_at
            if answered is None:
                return ()
            if self._clock() - answered > STALE_INTERVALS * self.interval_seconds:
                return ()
            return self._allocations

    def requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests)

    @property
    def last_success(self) -> float | None:
        with self._lock:
            return self._last_success
