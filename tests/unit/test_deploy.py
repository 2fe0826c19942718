"""deploy/'s Kubernetes manifests: rendered as `kubectl apply -k` renders them, validated against the
Kubernetes OpenAPI schema (kubernetes-validate's bundled copy, offline), wired to each other
(selectors, ports, volumes, the DNS names the proxy resolves), the proxy's flags accepted by
`epd-proxy serve` (the engines' flags by vLLM's own parser: tests/e2e/test_deploy_engine_flags.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from urllib.parse import urlsplit

import jsonschema
import pytest

from epd_proxy.addresses import is_dns
from epd_proxy.cli import build_parser, config_from_args
from epd_proxy.config import Config
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.registry import Registry
from epd_proxy.ops.autoscale import Autoscale
from epd_proxy.ops.metrics import Metrics
from tests.manifests import OVERLAYS, by_kind, proxy_container, render

# The oldest Kubernetes release still commonly supported, and the newest the bundled schema knows.
VERSIONS = ("1.30.0", "1.37.0")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_kubernetes(overlay, version):
    import kubernetes_validate

    docs = render(overlay)
    assert {doc["kind"] for doc in docs} == {"Deployment", "Service", "PersistentVolumeClaim"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # unknown fields are errors too


def test_the_pod_monitor_scrapes_the_proxy_pods():
    # A Prometheus Operator resource: not in the Kubernetes schema, so checked against the proxy here.
    (monitor,) = render("monitoring")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s", "honorLabels": True}
    proxy = by_kind(render("e-pd"), "Deployment")["epd-proxy"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    assert endpoint["port"] in {port["name"] for port in proxy_container(render("e-pd"))["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_objects_are_wired_to_each_other(overlay):
    docs = render(overlay)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    claims = by_kind(docs, "PersistentVolumeClaim")
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), name
        volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
        for container in pod["spec"]["containers"]:
            ports = {port["name"] for port in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    assert container[probe]["httpGet"]["port"] in ports, (name, probe)
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        assert name in services, f"{name} has no Service"
        service = services[name]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
        # The engines' Services are headless: one record per ready pod, which the proxy resolves.
        assert (service["spec"].get("clusterIP") == "None") == (name != "epd-proxy"), name
    assert all(claim["spec"]["accessModes"] == ["ReadWriteMany"] for claim in claims.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pd_prefill_and_decode_publishes_kv_events_on_ports_it_declares(overlay):
    docs = render(overlay)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    engines = {"e-pd": {"epd-pd"}, "e-p-d": {"epd-prefill", "epd-decode"}}[overlay]
    publishing = set()
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = [str(arg) for arg in container.get("args", [])]
        if "--kv-events-config" not in args:
            continue
        publishing.add(name)
        config = json.loads(args[args.index("--kv-events-config") + 1])
        assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq", name
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        # A `*` host makes vLLM's publisher bind (a concrete one would make it connect out).
        assert config["endpoint"] == f"tcp://*:{ports['kv-events']}", name
        assert config["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}", name
        served = {port["targetPort"] for port in services[name]["spec"]["ports"]}
        assert {"kv-events", "kv-replay"} <= served, name
    assert publishing == engines


def _serve_args(container: dict) -> list[str]:
    assert container["command"] == ["epd-proxy", "serve"]
    return [str(arg) for arg in container["args"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_proxy_flags_are_epd_proxy_serves(overlay):
    docs = render(overlay)
    args = _serve_args(proxy_container(docs))
    helped = subprocess.run(
        [sys.executable, "-m", "epd_proxy", "serve", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in (arg for arg in args if arg.startswith("--")):
        assert f"{flag} " in helped or f"{flag}\n" in helped, f"{flag} is not in `epd-proxy serve --help`"
    config = config_from_args(build_parser().parse_args(["serve", *args]), {})
    assert config.workers > 1 and config.port == 8000
    # Every DNS name the proxy resolves is a headless Service of this overlay, with that port.
    services = by_kind(docs, "Service")
    entries = [e for e in (*config.encode_urls, *config.prefill_urls, *config.decode_urls) if is_dns(e)]
    assert len(entries) == len(config.encode_urls) + len(config.prefill_urls) + len(config.decode_urls)
    for entry in entries:
        parts = urlsplit(entry)
        if parts.scheme == "dns":
            service, port_of = services[parts.hostname], lambda port, want=parts.port: port["port"] == want
        else:
            label, _, name = parts.hostname.split(".", 2)  # _http._tcp.NAME
            service, port_of = services[name], lambda port, want=label[1:]: port["name"] == want
        assert service["spec"]["clusterIP"] == "None" and any(port_of(p) for p in service["spec"]["ports"]), entry
    roles = {"encode": config.encode_urls, "prefill": config.prefill_urls}
    assert bool(roles["prefill"]) == (overlay == "e-p-d")


# deploy/autoscaling/: the HPA against the Kubernetes schema, the KEDA ScaledObject against the part
# of KEDA's CRD it uses, both aimed at the encoder Deployment and at series the proxy exports.
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
# KEDA 2.x's ScaledObject, the fields these manifests use (keda.sh_scaledobjects.yaml), closed
# so that a misspelt field fails as the API server would refuse it.
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": _STRINGS,
                        },
                    },
                },
            },
        },
    },
}


def exported_names() -> set[str]:
    fleet, health = Registry(dynamic=True), Health()
    fleet.register({"role": "encode", "url": "http://e:1"})
    metrics = Metrics(fleet, health)
    metrics.watch_autoscale(Autoscale(Lanes()))
    text = metrics.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def encoder_deployment() -> dict:
    return by_kind(render("e-pd"), "Deployment")["epd-encoder"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_hpa_is_valid_and_scales_the_encoders_on_an_exported_series(version):
    import kubernetes_validate

    (hpa,) = render("autoscaling/hpa")
    kubernetes_validate.validate(hpa, version, strict=True)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "epd-encoder") and encoder_deployment()
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] in exported_names()
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": "encode"}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "700m"}
    assert Config.__dataclass_fields__["autoscale_utilisation"].default == 0.7


def test_the_scaled_object_is_valid_and_queries_exported_series():
    (scaled,) = render("autoscaling/keda")
    jsonschema.validate(scaled, SCALED_OBJECT)
    assert scaled["spec"]["scaleTargetRef"]["name"] == encoder_deployment()["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == Config.__dataclass_fields__["autoscale_utilisation"].default
    queried = set(re.findall(r"\b(epd_[a-z_]+)\{", trigger["metadata"]["query"]))
    assert queried and queried <= exported_names(), queried - exported_names()


def test_a_misspelt_field_fails_the_schema():
    (scaled,) = render("autoscaling/keda")
    scaled["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCALED_OBJECT)
