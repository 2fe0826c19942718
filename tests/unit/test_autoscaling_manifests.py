"""deploy/autoscaling/: the HPA validated against the Kubernetes schema, the KEDA ScaledObject
against the part of KEDA's CRD it uses, both aimed at the encoder Deployment and at series the
proxy exports, with the proxy's own target utilisation."""

from __future__ import annotations

import re

import jsonschema
import pytest

from epd_proxy.config import Config
from epd_proxy.fleet.health import Health
from epd_proxy.fleet.lanes import Lanes
from epd_proxy.fleet.registry import Registry
from epd_proxy.ops.autoscale import Autoscale
from epd_proxy.ops.metrics import Metrics
from tests.manifests import by_kind, render
from tests.unit.test_deploy import VERSIONS

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
