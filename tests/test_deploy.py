"""The deployment files are real: deploy/k8s against Kubernetes' own OpenAPI schemas (kubernetes-validate,
strict: an unknown field is an error), the custom resources against the fields their CRDs require, every
container's arguments through kvseal's own parser, and the wiring between them (Services name Deployments'
ports, the router's worker URLs name Services)."""

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvseal.cli import parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.33"
# What the CRDs require (inference.networking.k8s.io/v1 InferencePool, monitoring.coreos.com/v1 ServiceMonitor)
PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "additionalProperties": False,
                                "required": ["selector", "targetPorts", "endpointPickerRef"],
                                "properties": {
                                    "selector": {"type": "object", "required": ["matchLabels"]},
                                    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                                    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                                    "endpointPickerRef": {
                                        "type": "object", "required": ["name"], "additionalProperties": False,
                                        "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                                       "name": {"type": "string"}, "port": PORT,
                                                       "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "required": ["selector", "endpoints"],
                                "properties": {"endpoints": {"type": "array", "minItems": 1, "items": {
                                    "type": "object", "required": ["port"]}}}}}},
}


def docs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_against_its_schema(doc):
    crd = CRDS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        jsonschema.validate(doc, crd)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_manifests_wire_together_and_their_arguments_are_kvseals():
    deployments = {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Service"}
    assert set(deployments) == {"kvseal-router", "kvseal-prefill", "kvseal-decode"}
    for name, svc in services.items():
        pod = deployments[name]["spec"]["template"]
        assert all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    for name, dep in deployments.items():
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        a = parser().parse_args([x.replace("$(POD_IP)", "10.0.0.1") for x in c["args"]])
        assert a.cmd == name.removeprefix("kvseal-")
        assert a.port == c["ports"][0]["containerPort"]
        if a.cmd == "router":
            for url in a.prefill + a.decode:
                host, port = url.removeprefix("http://").split(":")
                assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
        else:
            assert a.transport == "mooncake", "pod to pod, the pages travel over Mooncake"


def test_prometheus_scrapes_the_ports_serve_uses():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    ports = sorted(int(t.rsplit(":", 1)[1]) for j in cfg["scrape_configs"] for s in j["static_configs"]
                   for t in s["targets"])
    serve = parser().parse_args(["serve"])
    assert ports == [serve.port, serve.port + 1, serve.port + 2]
