"""The deployment files as written: docker/compose.yaml and deploy/kuberay/*.yaml.

- **Compose** (checked statically here; the machine has no Docker engine): every service that runs Ray (the
  head runs the driver, the workers the actors) mounts the output folder `runs/` at the same path, from the
  same image, with the same Ray token; the docs' output_dir lies under that path. A worker without the mount
  failed every shard (`LeaseLostError`). Where `docker` is installed: `docker compose config` accepts the file.
- **KubeRay**: the RayJob and the RayCluster have the fields KubeRay's CRDs (ray.io/v1, KubeRay 1.1+) require
  (`REQUIRED`, written from KubeRay's documented schema: the CRD files are not available on this machine),
  with the types the CRDs take (rayStartParams values are strings); they run `jobs.generate` on the
  project's image, joining the cluster, one actor per GPU on an autoscaling GPU group, object-store input and
  output, MLflow's URI the same in the entrypoint and the head's `MLFLOW_TRACKING_URI`, credentials from a
  secret and never in the file; the entrypoint's overrides are keys the job's config takes. Where `kubectl`
  is installed and reaches a cluster with KubeRay's CRDs: a server-side dry run.
Negative controls: each check rejects a manifest with the fault it looks for.
"""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
KUBERAY = ROOT / "deploy" / "kuberay"
RUNS_IN_CONTAINER = "/home/ray/spectr/runs"

# KubeRay's CRDs (ray.io/v1): the fields each object requires, as dotted paths ("[]": every item of a list).
# rayStartParams is optional since KubeRay 1.1; a Pod template needs containers, each a name and an image.
REQUIRED = {
    "RayCluster": ["apiVersion", "kind", "metadata.name", "spec.headGroupSpec", "spec.headGroupSpec.template",
                   "spec.headGroupSpec.template.spec.containers", "spec.headGroupSpec.template.spec.containers[].name",
                   "spec.headGroupSpec.template.spec.containers[].image", "spec.workerGroupSpecs[].groupName",
                   "spec.workerGroupSpecs[].template.spec.containers[].name",
                   "spec.workerGroupSpecs[].template.spec.containers[].image"],
}
REQUIRED["RayJob"] = ["apiVersion", "kind", "metadata.name", "spec.entrypoint", "spec.rayClusterSpec"] + [
    "spec.rayClusterSpec." + path[len("spec."):] for path in REQUIRED["RayCluster"] if path.startswith("spec.")]
SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_TRACKING_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS_JSON")


# -- compose --------------------------------------------------------------------------------------------------------

def compose_problems(compose: dict) -> list[str]:
    """What keeps the compose file from running the job as docker/README.md says."""
    services = compose["services"]
    ray = {name: s for name, s in services.items() if "ray start" in str(s.get("command", ""))}
    problems = []
    if len(ray) < 2:
        problems.append(f"expected a Ray head and a worker, found {sorted(ray)}")
    images = {s.get("image") for s in ray.values()}
    if len(images) != 1:
        problems.append(f"the Ray services run different images: {sorted(map(str, images))}")
    for name, service in ray.items():
        mounts = [str(v) for v in service.get("volumes", [])]
        if not any(m.split(":")[1:2] == [RUNS_IN_CONTAINER] and m.split(":")[0].rstrip("/").endswith("runs")
                   for m in mounts):
            problems.append(f"{name} does not mount runs/ at {RUNS_IN_CONTAINER} (its actors or driver write there)")
        if "RAY_AUTH_TOKEN" not in (service.get("environment") or {}):
            problems.append(f"{name} has no RAY_AUTH_TOKEN (every node shares one)")
    return problems


def test_every_ray_service_of_compose_mounts_the_output_folder():
    compose = yaml.safe_load(COMPOSE.read_text())
    assert compose_problems(compose) == []
    readme = (ROOT / "docker" / "README.md").read_text()
    assert f"output_dir={RUNS_IN_CONTAINER}/" in readme  # the documented output_dir is inside the mount


def test_compose_check_rejects_a_worker_without_the_mount():
    compose = yaml.safe_load(COMPOSE.read_text())
    compose["services"]["ray-gpu-worker"].pop("volumes")
    assert compose_problems(compose) == [f"ray-gpu-worker does not mount runs/ at {RUNS_IN_CONTAINER} (its actors "
                                         "or driver write there)"]


def docker_compose_works() -> bool:
    """A docker client with the compose plugin, talking to an engine."""
    if shutil.which("docker") is None:
        return False
    for command in (["docker", "compose", "version"], ["docker", "info", "--format", "{{.ServerVersion}}"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode != 0 or not done.stdout.strip():
            return False
    return True


DOCKER = pytest.mark.skipif(not docker_compose_works(),
                            reason="no docker compose with an engine here: the compose file is checked statically")


@DOCKER
def test_docker_compose_accepts_the_file(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    done = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@DOCKER
@pytest.mark.slow  # builds the image (minutes, network); the static check above is the default suite's
def test_a_head_and_a_worker_come_up_and_share_runs(monkeypatch, tmp_path):
    """docker compose up of the head and one worker (its GPU reservation reset, for a machine without one): both
    Ray nodes join, and a file the worker writes under runs/ is seen by the head and on the host."""
    import secrets
    import time

    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    override = tmp_path / "no-gpu.yaml"
    override.write_text("services:\n  ray-gpu-worker:\n    deploy: !reset null\n")
    base = ["docker", "compose", "-p", "spectr-test", "-f", str(COMPOSE), "-f", str(override)]
    (ROOT / "runs").mkdir(exist_ok=True)
    try:
        up = subprocess.run(base + ["up", "-d", "--build", "ray-head", "ray-gpu-worker"], capture_output=True,
                            text=True, timeout=1800)
        assert up.returncode == 0, up.stderr[-2000:]
        for _ in range(60):
            status = subprocess.run(base + ["exec", "-T", "ray-head", "ray", "status"], capture_output=True, text=True)
            if status.stdout.count("node_") >= 2:
                break
            time.sleep(5)
        assert status.stdout.count("node_") >= 2, status.stdout
        name = f"compose-check-{secrets.token_hex(4)}"
        wrote = subprocess.run(base + ["exec", "-T", "ray-gpu-worker", "touch", f"{RUNS_IN_CONTAINER}/{name}"],
                               capture_output=True, text=True)
        assert wrote.returncode == 0, wrote.stderr
        seen = subprocess.run(base + ["exec", "-T", "ray-head", "ls", RUNS_IN_CONTAINER], capture_output=True, text=True)
        assert name in seen.stdout and (ROOT / "runs" / name).exists()
        (ROOT / "runs" / name).unlink()
    finally:
        subprocess.run(base + ["down"], capture_output=True, timeout=300)


# -- KubeRay --------------------------------------------------------------------------------------------------------

def manifests() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(KUBERAY.glob("*.yaml"))}


def values_at(node, path: str) -> list:
    """The values at a dotted path ("a.b[].c": every item of the list b); a missing step gives no value."""
    found = [node]
    for part in path.split("."):
        each = part.endswith("[]")
        key = part[:-2] if each else part
        found = [n[key] for n in found if isinstance(n, dict) and key in n]
        if each:
            found = [item for n in found if isinstance(n, list) for item in n]
    return found


def missing_fields(manifest: dict) -> list[str]:
    missing = []
    for path in REQUIRED[manifest["kind"]]:
        parent = path.rsplit("[]", 1)[0] if "[]" in path else None
        values = values_at(manifest, path)
        count = len(values_at(manifest, parent + "[]")) if parent else 1
        if len(values) < max(count, 1) or any(v in (None, "", []) for v in values):
            missing.append(path)
    return missing


def cluster_spec(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]


def kuberay_problems(manifest: dict) -> list[str]:
    """The CRDs' required fields and types, and what the job needs of the cluster."""
    problems = [f"missing {path}" for path in missing_fields(manifest)]
    if manifest.get("apiVersion") != "ray.io/v1":
        problems.append(f"apiVersion {manifest.get('apiVersion')!r}, expected ray.io/v1")
    spec = cluster_spec(manifest)
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    for group in groups:
        for key, value in (group.get("rayStartParams") or {}).items():
            if not isinstance(value, str):
                problems.append(f"rayStartParams.{key} is {value!r}: KubeRay takes strings only")
    images = {c.get("image") for g in groups for c in g["template"]["spec"]["containers"]} - {None}
    if len(images) != 1 or "spectr-pipeline" not in next(iter(images)):
        problems.append(f"the head and the workers must run the project's one image, found {sorted(images)}")
    if spec.get("rayVersion") != ray_version():
        problems.append(f"rayVersion {spec.get('rayVersion')!r} is not the image's Ray {ray_version()!r}")
    gpu_groups = [g for g in spec.get("workerGroupSpecs", [])
                  if all("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                         for c in g["template"]["spec"]["containers"])]
    if not gpu_groups:
        problems.append("no worker group with nvidia.com/gpu limits")
    for g in spec.get("workerGroupSpecs", []):
        low, high, start = g.get("minReplicas", 0), g.get("maxReplicas", 2 ** 31), g.get("replicas", 0)
        if not low <= start <= high:
            problems.append(f"worker group {g['groupName']}: replicas {start} outside [{low}, {high}]")
    if gpu_groups and min(g.get("minReplicas", 0) for g in gpu_groups) == 0 and not spec.get("enableInTreeAutoscaling"):
        problems.append("a GPU group of minReplicas 0 without enableInTreeAutoscaling never gets a node")
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            for env in c.get("env", []):
                if env.get("name") in SECRET_NAMES and "value" in env:
                    problems.append(f"{c['name']}: {env['name']} written in the manifest (use a secret)")
            if not any("secretRef" in e for e in c.get("envFrom", [])):
                problems.append(f"{c['name']}: no envFrom secretRef for the object store's and MLflow's credentials")
    return problems


def ray_version() -> str:
    import ray

    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile  # the image's Ray is the one the project pins
    return ray.__version__


def entrypoint_overrides(entrypoint: str) -> dict[str, str]:
    words = shlex.split(entrypoint)
    assert words[:3] == ["python", "-m", "jobs.generate"], words[:3]
    return dict(word.split("=", 1) for word in words[3:])


@pytest.mark.parametrize("name", ["rayjob.yaml", "raycluster.yaml"])
def test_kuberay_manifests_have_what_the_crds_and_the_job_need(name):
    manifest = manifests()[name]
    assert manifest["kind"] == {"rayjob.yaml": "RayJob", "raycluster.yaml": "RayCluster"}[name]
    assert kuberay_problems(manifest) == []
    head = cluster_spec(manifest)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head runs no actors


def test_the_rayjob_runs_the_job_on_the_gpu_group_with_object_storage_and_mlflow():
    """The entrypoint's overrides: the cluster joined, one actor per GPU, object-store input and output, MLflow's
    URI the head's MLFLOW_TRACKING_URI; and each key is one the job's config takes (composed by Hydra here)."""
    from hydra import compose, initialize_config_dir

    from pipeline.generate.config import from_omegaconf

    manifest = manifests()["rayjob.yaml"]
    overrides = entrypoint_overrides(manifest["spec"]["entrypoint"])
    assert overrides["ray"] == "cluster" and overrides["ray.gpus_per_actor"] == "1"
    assert overrides["data.path"].startswith("s3://") and overrides["output_dir"].startswith("s3://")
    head = cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert overrides["mlflow.tracking_uri"] == env["MLFLOW_TRACKING_URI"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        config = compose("generate", overrides=[f"{k}={v}" for k, v in overrides.items()])
    typed = from_omegaconf(config)  # every key exists and has a valid value (paths are not opened here)
    assert typed.ray.gpus_per_actor == 1 and typed.ray.address == "auto"


def test_the_kuberay_checks_reject_a_broken_manifest():
    """Controls: a missing worker image, an int rayStartParams value, a secret written in, no autoscaling for a GPU
    group of zero: each is named."""
    manifest = copy.deepcopy(manifests()["raycluster.yaml"])
    worker = manifest["spec"]["workerGroupSpecs"][0]
    del worker["template"]["spec"]["containers"][0]["image"]
    manifest["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "x"})
    manifest["spec"]["enableInTreeAutoscaling"] = False
    problems = kuberay_problems(manifest)
    assert "missing spec.workerGroupSpecs[].template.spec.containers[].image" in problems
    assert "rayStartParams.num-cpus is 0: KubeRay takes strings only" in problems
    assert "ray-head: AWS_SECRET_ACCESS_KEY written in the manifest (use a secret)" in problems
    assert "a GPU group of minReplicas 0 without enableInTreeAutoscaling never gets a node" in problems


def kubectl_reaches_kuberay() -> bool:
    if shutil.which("kubectl") is None:
        return False
    done = subprocess.run(["kubectl", "get", "crd", "rayjobs.ray.io"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not kubectl_reaches_kuberay(), reason="no kubectl reaching a cluster with KubeRay's CRDs here")
@pytest.mark.parametrize("name", ["rayjob.yaml", "raycluster.yaml"])
def test_server_side_dry_run(name):
    done = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", str(KUBERAY / name)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
