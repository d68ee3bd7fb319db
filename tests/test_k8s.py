"""KubeRay manifests: they parse, carry the fields KubeRay and the cluster need, their Serve args validate with
our config model, the import_path imports, and the kustomize overlays apply to the base."""

import copy
import importlib
from pathlib import Path

import pytest
import yaml

from configs import ServeArgs

K8S = Path(__file__).resolve().parents[1] / "k8s"
MANIFESTS = sorted((K8S / "base").glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base(kind: str) -> dict:
    return next(d for p in MANIFESTS for d in documents(p) if d.get("kind") == kind)


def pointer(doc, path: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.strip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, (int(parts[-1]) if isinstance(doc, list) else parts[-1])


def apply_json6902(doc: dict, ops: list[dict]) -> dict:
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "replace", op
        parent, key = pointer(doc, op["path"])
        assert (key in parent) if isinstance(parent, dict) else key < len(parent), f"{op['path']} does not exist"
        parent[key] = op["value"]
    return doc


def check_cluster_spec(spec: dict) -> None:
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for pod in [head["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["image"] and c["resources"]["requests"] and c["resources"]["limits"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
    for group in spec["workerGroupSpecs"]:
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def check_serve_config(service: dict) -> list[ServeArgs]:
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    parsed = []
    for app in config["applications"]:
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        parsed.append(ServeArgs.model_validate(app["args"]))
    return parsed


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_parses_and_has_its_required_fields(path):
    for doc in documents(path):
        if doc.get("kind") == "Kustomization":
            assert all((path.parent / r).exists() for r in doc["resources"])
            continue
        assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
        spec = doc["spec"]
        if doc["kind"] == "RayService":
            check_cluster_spec(spec["rayClusterConfig"])
            check_serve_config(doc)
            probe = spec["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["readinessProbe"]
            assert probe["httpGet"]["path"] == "/health"
        elif doc["kind"] == "RayJob":
            assert spec["entrypoint"] and spec["shutdownAfterJobFinishes"] is True
            check_cluster_spec(spec["rayClusterSpec"])
        else:
            assert doc["kind"] == "RayCluster"
            check_cluster_spec(spec)


@pytest.mark.parametrize("overlay,tp,gpus,drafter", [("single-node", 1, "2", "separate"),
                                                     ("multi-node", 8, "4", "colocated")])
def test_overlays_apply_and_validate(overlay, tp, gpus, drafter):
    folder = K8S / "overlays" / overlay
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert (folder / kustomization["resources"][0]).resolve() == (K8S / "base").resolve()
    patch = kustomization["patches"][0]
    assert patch["target"]["kind"] == "RayService"
    service = apply_json6902(base("RayService"), yaml.safe_load((folder / patch["path"]).read_text()))
    check_cluster_spec(service["spec"]["rayClusterConfig"])
    args = check_serve_config(service)[0]
    assert (args.parallel.tensor_parallel_size, args.parallel.drafter) == (tp, drafter)
    worker = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_bad_serve_args_are_refused():
    args = yaml.safe_load(base("RayService")["spec"]["serveConfigV2"])["applications"][0]["args"]
    with pytest.raises(ValueError, match="unknown_option"):
        ServeArgs.model_validate({**args, "unknown_option": 1})
    with pytest.raises(ValueError, match="min_replicas"):
        ServeArgs.model_validate({**args, "deployment": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}})


def test_the_dockerfile_builds_the_image_the_manifests_run():
    """Image name and version, Ray version, Python version, user and the /health port agree between the
    Dockerfile and every manifest (nothing builds the image in CI: this keeps the two from drifting apart)."""
    import re

    root = K8S.parent
    docker = (root / "Dockerfile").read_text()
    version = re.search(r'^version = "([^"]+)"$', (root / "pyproject.toml").read_text(), re.M).group(1)
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", docker, re.M).group(1)
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py312-gpu$", docker, re.M)
    assert f'org.opencontainers.image.version="{version}"' in docker
    assert f"docker build -t dspark:{version} ." in docker
    assert re.search(r"^USER ray$", docker, re.M)  # Ray's image user: uid 1000
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", docker, re.M).group(1).split()}
    images, ray_versions, users, health_ports = set(), set(), set(), set()

    def walk(node):
        if isinstance(node, dict):
            if "image" in node:
                images.add(node["image"])
            if "rayVersion" in node:
                ray_versions.add(node["rayVersion"])
            if "runAsUser" in node:
                users.add(node["runAsUser"])
            if node.get("httpGet", {}).get("path") == "/health":
                health_ports.add(node["httpGet"]["port"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in MANIFESTS:
        for doc in documents(path):
            walk(doc)
    assert images == {f"dspark:{version}"} and ray_versions == {ray_version} and users == {1000}
    assert health_ports and health_ports <= exposed and {8000, 8080} <= exposed
    assert (root / ".dockerignore").read_text().split().count(".venv") == 1
