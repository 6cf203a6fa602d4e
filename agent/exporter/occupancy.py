"""Exposition of who holds each device, and of the kubelet's PodResources answers::

    sustain_device_pod_info{container="main",device="1",namespace="ml",pod="train-0",
                            uuid="GPU-2b9e..."} 1.0
    sustain_podresources_device_containers{device="1",uuid="GPU-2b9e..."} 1.0
    sustain_podresources_requests_total{outcome="ok"} 42.0
    sustain_podresources_last_success_timestamp_seconds 1.7634e+09

Join the info series on ``uuid`` to name the pod behind any device series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.occupancy.tracker import MAX_PODS_PER_DEVICE, OccupancyStatus


def occupancy_families(status: OccupancyStatus) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "sustain_device_pod_info",
        "The Kubernetes container the kubelet allocated the device to (PodResources API); "
        "value 1. Absent off Kubernetes and once the kubelet has not answered for three "
        "intervals.",
        labels=["device", "uuid", "namespace", "pod", "container"],
    )
    for row in status.pods:
        info.add_metric(list(row), 1.0)
    yield info
    containers = GaugeMetricFamily(
        "sustain_podresources_device_containers",
        "Containers the kubelet allocated the device to; sustain_device_pod_info names at most "
        f"{MAX_PODS_PER_DEVICE} of them per device (the first by namespace, pod, container).",
        labels=["device", "uuid"],
    )
    counts = Counter((device, uuid) for device, uuid, *_ in status.pods)
    counts.update(status.omitted)
    for (device, uuid), count in sorted(counts.items()):
        containers.add_metric([device, uuid], count)
    yield containers
    requests = CounterMetricFamily(
        "sustain_podresources_requests",
        "Calls to the kubelet's PodResources List, by outcome (ok, no_socket, unavailable, "
        "timeout, error, no_grpc).",
        labels=["outcome"],
    )
    for outcome, count in sorted(status.requests.items()):
        requests.add_metric([outcome], count)
    yield requests
    if status.last_success is not None:
        yield GaugeMetricFamily(
            "sustain_podresources_last_success_timestamp_seconds",
            "Unix time of the kubelet's last PodResources answer.",
            value=status.last_success,
        )
