"""The cluster definitions in cluster/: every YAML parses once its ${NAME} placeholders are rendered,
has the fields KubeRay and the Ray cluster launcher require, and agrees with this repository —
entrypoints name real `mdc` commands and options, config paths exist, Ray versions match."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import typer
import yaml
from typer.testing import CliRunner

from mdc.config import load_config
from pipelines.cli import app

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
DOCKERFILE = (CLUSTER / "Dockerfile").read_text()
PLACEHOLDER = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")
TEST_VALUES = {
    "IMAGE": "registry.example.com/mdc:test",
    "KUBECTL_IMAGE": "registry.example.com/kubectl:test",
    "BUCKET": "mdc-test-bucket",
    "DATA": "s3://mdc-test-data/cc3m",
    "PROBE_DATA": "s3://mdc-test-data/shapes",
    "RUN_NAME": "vit-b16-test",
    "MLFLOW_URI": "http://mlflow.example.com:5000",
    "GPU_INSTANCE_TYPE": "p4d.24xlarge",
    "GPU_WORKERS": "1",
    "SPOT_GPU_WORKERS": "1",
    "HEAD_INSTANCE_TYPE": "m5.2xlarge",
    "AWS_REGION": "us-west-2",
    "CPU_WORKERS": "3",
    "CPU_INSTANCE_TYPE": "c6i.8xlarge",
}
INSTANCE_TYPES = yaml.safe_load((CLUSTER / "instance-types.yaml").read_text())
GPU_TYPES = sorted(name for name, row in INSTANCE_TYPES.items() if row["gpus"])


def kubelet_reserve(row: dict) -> tuple[int, int]:
    """(vCPUs, GiB) a node keeps for the kubelet, system daemons and DaemonSets: max(1, 10%), max(4 GiB, 10%)."""
    return max(1, -(-row["vcpu"] // 10)), max(4, -(-row["memory_gib"] // 10))


def derived(values: dict) -> dict:
    """The pod sizes cluster/render.sh derives from cluster/instance-types.yaml."""
    out = {}
    for group in ("HEAD", "GPU", "CPU"):
        row = INSTANCE_TYPES[values[f"{group}_INSTANCE_TYPE"]]
        cpu, gib = kubelet_reserve(row)
        out[f"{group}_POD_CPU"] = str(row["vcpu"] - cpu)
        out[f"{group}_POD_MEMORY"] = f"{row['memory_gib'] - gib}Gi"
    out["GPU_POD_GPUS"] = str(INSTANCE_TYPES[values["GPU_INSTANCE_TYPE"]]["gpus"])
    gpus, on_demand = int(out["GPU_POD_GPUS"]), int(values["GPU_WORKERS"])
    out["TRAIN_WORKERS_MIN"] = str(on_demand * gpus)
    out["TRAIN_WORKERS"] = str((on_demand + int(values.get("SPOT_GPU_WORKERS", 0))) * gpus)
    return out


YAMLS = sorted(CLUSTER.rglob("*.yaml"))
TEMPLATES = [p for p in YAMLS if PLACEHOLDER.search(p.read_text())]
RAY_VERSION = re.search(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILE, re.M).group(1)
PROJECT_DIR = re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1)  # where the image holds the repo
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}


def render(text: str, values: dict = TEST_VALUES) -> str:
    """What `cluster/render.sh` (envsubst) makes of a file, with `values` as the environment."""
    values = {**values, **derived(values)}
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render(path.read_text())) if doc is not None]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in docs}


def scheduled_rayjob() -> dict:
    """The RayJob that the scaling CronJob creates, from its ConfigMap."""
    config_map = by_kind(load(KUBERAY / "scaling-cronjob.yaml"))["ConfigMap"]
    return yaml.safe_load(config_map["data"]["rayjob.yaml"])


def rayjobs() -> dict[str, dict]:
    return {
        "rayjob-pretrain.yaml": by_kind(load(KUBERAY / "rayjob-pretrain.yaml"))["RayJob"],
        "rayjob-sweep.yaml": by_kind(load(KUBERAY / "rayjob-sweep.yaml"))["RayJob"],
        "scaling-cronjob.yaml (ConfigMap)": scheduled_rayjob(),
    }


def repo_path(path: str) -> Path:
    """A path as a cluster YAML gives it (inside the image, or relative to a working dir) → the repo."""
    return REPO / path.removeprefix(PROJECT_DIR + "/") if path.startswith(PROJECT_DIR + "/") else REPO / path


# ----------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CLUSTER)))
def test_every_yaml_parses_after_rendering(path):
    unknown = set(PLACEHOLDER.findall(path.read_text())) - set(TEST_VALUES) - set(derived(TEST_VALUES))
    assert not unknown, f"{path}: placeholders without a test value: {unknown}"
    docs = load(path)
    assert docs, f"{path}: no YAML documents"
    assert "${" not in json.dumps(docs)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: str(p.relative_to(CLUSTER)))
def test_placeholders_are_listed_in_the_header(path):
    lines = path.read_text().splitlines()
    header = [line for line in lines if re.match(r"#\s+\$\{", line)]
    documented = {PLACEHOLDER.search(line).group(1) for line in header}
    used = {name for line in lines if not line.lstrip().startswith("#") for name in PLACEHOLDER.findall(line)}
    assert used == documented, f"{path}: used {sorted(used)}, listed {sorted(documented)}"


@pytest.mark.skipif(shutil.which("envsubst") is None, reason="envsubst (gettext-base) not installed")
@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: str(p.relative_to(CLUSTER)))
def test_render_script_fills_placeholders_and_names_missing_ones(path):
    env = {**os.environ, **TEST_VALUES}
    out = subprocess.run([str(CLUSTER / "render.sh"), str(path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == render(path.read_text())
    del env["IMAGE"]
    missing = subprocess.run([str(CLUSTER / "render.sh"), str(path)], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "IMAGE" in missing.stderr


def test_dockerfile_copies_paths_that_exist_and_pins_the_ray_in_use():
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M):
        *sources, _ = [arg for arg in line.split() if not arg.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"cluster/Dockerfile: COPY {source}: not in the repository"
    assert RAY_VERSION == ray.__version__, "cluster/Dockerfile RAY_VERSION differs from the Ray installed here"


DOCKER_CHECKS = re.findall(r"python -c (\"[^\"]*\"|'[^']*')", DOCKERFILE)


def test_dockerfile_has_python_checks():
    assert DOCKER_CHECKS, "cluster/Dockerfile: no `python -c` check of the installed package"


@pytest.mark.parametrize("check", DOCKER_CHECKS)
def test_dockerfile_python_checks_run_in_the_project_env(check):
    """What the image build runs after `pip install -e .`, run here against this checkout."""
    out = subprocess.run(
        [sys.executable, "-c", shlex.split(check)[0]],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, f"cluster/Dockerfile: python -c {check} fails: {out.stderr.strip().splitlines()[-1:]}"


# ----------------------------------------------------------------------------- pods fit their nodes


def pods(doc: dict):
    """(where, node type, container) of every Ray pod a rendered KubeRay file asks for."""
    if doc["kind"] == "ConfigMap":
        doc = yaml.safe_load(doc["data"]["rayjob.yaml"])
    spec = doc["spec"].get("rayClusterSpec", doc["spec"]) if doc["kind"] in ("RayJob", "RayCluster") else None
    if spec is None:
        return
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    for name, group in groups:
        pod = group["template"]["spec"]
        node = pod.get("nodeSelector", {}).get("node.kubernetes.io/instance-type")
        for container in pod["containers"]:
            yield f"{doc['kind']} {name}", node, container


def gib(quantity: str) -> float:
    units = {"Gi": 1, "Mi": 1 / 1024, "Ti": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.skipif(shutil.which("envsubst") is None, reason="envsubst (gettext-base) not installed")
@pytest.mark.parametrize("gpu_type", GPU_TYPES)
@pytest.mark.parametrize("path", sorted(KUBERAY.glob("*.yaml")), ids=lambda p: p.name)
def test_every_rendered_pod_fits_its_node_with_room_for_the_kubelet(path, gpu_type):
    env = {**os.environ, **TEST_VALUES, "GPU_INSTANCE_TYPE": gpu_type}
    out = subprocess.run([str(CLUSTER / "render.sh"), str(path)], env=env, capture_output=True, text=True, check=True)
    seen = 0
    for doc in yaml.safe_load_all(out.stdout):
        for where, node, container in pods(doc):
            seen += 1
            assert node in INSTANCE_TYPES, f"{path.name}: {where}: node type {node!r} is not in instance-types.yaml"
            row, (cpu_reserve, gib_reserve) = INSTANCE_TYPES[node], kubelet_reserve(INSTANCE_TYPES[node])
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            assert requests == limits, f"{path.name}: {where}: requests != limits (Guaranteed QoS)"
            assert int(requests["cpu"]) <= row["vcpu"] - cpu_reserve, f"{path.name}: {where} on {node}: cpu"
            assert gib(requests["memory"]) <= row["memory_gib"] - gib_reserve, f"{path.name}: {where} on {node}: memory"
            if "nvidia.com/gpu" in requests:  # one pod per node, all its GPUs: NCCL over NVLink inside it
                assert node == gpu_type and int(requests["nvidia.com/gpu"]) == row["gpus"], f"{path.name}: {where}"
            else:
                assert row["gpus"] == 0 or where.endswith("head"), f"{path.name}: {where}: a CPU pod on a GPU node"
    assert seen >= 3, f"{path.name}: expected a head, a GPU and a CPU group"


@pytest.mark.parametrize("where", ["rayjob-pretrain.yaml", "scaling-cronjob.yaml (ConfigMap)"])
@pytest.mark.parametrize("gpu_type", GPU_TYPES)
@pytest.mark.parametrize("spot", ["0", "1"])
def test_training_workers_are_one_per_gpu_and_fit_the_gpu_pod(where, gpu_type, spot):
    """One worker per GPU; with spot nodes, elastic from the on-demand GPUs to all of them; without,
    a fixed count."""
    values = {**TEST_VALUES, "GPU_INSTANCE_TYPE": gpu_type, "SPOT_GPU_WORKERS": spot}
    path = KUBERAY / ("rayjob-pretrain.yaml" if where.startswith("rayjob") else "scaling-cronjob.yaml")
    docs = by_kind([d for d in yaml.safe_load_all(render(path.read_text(), values)) if d])
    job = docs["RayJob"] if "RayJob" in docs else yaml.safe_load(docs["ConfigMap"]["data"]["rayjob.yaml"])
    tokens = shlex.split(job["spec"]["entrypoint"])
    overrides = [t for t in tokens[2:] if "=" in t and not t.startswith("-")]
    config = load_config(repo_path(tokens[tokens.index("--config") + 1]), overrides)
    sizes, gpus = derived(values), INSTANCE_TYPES[gpu_type]["gpus"]
    on_demand, spot = int(values["GPU_WORKERS"]), int(values["SPOT_GPU_WORKERS"])
    assert (config.workers.min, config.workers.max) == (on_demand * gpus, (on_demand + spot) * gpus)
    assert config.workers.elastic == bool(spot)
    if gpu_type != "g5.xlarge":  # 4 vCPUs: too few for a GPU's data loading; README names g5.2xlarge and up
        assert config.workers.cpus * int(sizes["GPU_POD_GPUS"]) <= int(sizes["GPU_POD_CPU"]), gpu_type


@pytest.mark.parametrize("gpu_type", [t for t in GPU_TYPES if t != "g5.xlarge"])
def test_sweep_runs_one_trial_per_gpu_node_and_the_cluster_fits_as_many_at_once(gpu_type):
    """The sweep RayJob: `mdc tune` over a shipped space, each trial on one node's GPUs, and the
    default concurrency (what fits the free resources) is one trial per GPU node."""
    from pipelines.commands.search_space import load_space
    from pipelines.commands.tune import trial_count
    from pipelines.run.concurrency import fitting_runs

    values = {**TEST_VALUES, "GPU_INSTANCE_TYPE": gpu_type, "GPU_WORKERS": "3"}
    job = by_kind([d for d in yaml.safe_load_all(render((KUBERAY / "rayjob-sweep.yaml").read_text(), values)) if d])
    tokens = shlex.split(job["RayJob"]["spec"]["entrypoint"])
    assert tokens[:2] == ["mdc", "tune"] and "--max-concurrent" not in tokens  # the default: what fits
    overrides = [t for t in tokens[2:] if "=" in t and not t.startswith("-")]
    config = load_config(repo_path(tokens[tokens.index("--config") + 1]), overrides)
    space = load_space(repo_path(tokens[tokens.index("--space") + 1]), config)
    sizes = derived(values)
    assert config.workers.count == int(sizes["GPU_POD_GPUS"]) and config.workers.use_gpu
    free = {
        "GPU": 3.0 * int(sizes["GPU_POD_GPUS"]),
        "CPU": 3.0 * int(sizes["GPU_POD_CPU"]) + int(values["CPU_WORKERS"]) * int(sizes["CPU_POD_CPU"]),
    }
    assert fitting_runs([config] * trial_count(space), free) == 3, gpu_type  # what run_sweep counts


# --------------------------------------------------------------------------------------- KubeRay


def check_ray_cluster_spec(spec: dict, where: str) -> None:
    """The RayClusterSpec fields KubeRay needs, one GPU worker group, one fixed CPU-only group for
    Ray Data (up before training, since the ingest budget is counted at its start), the project image
    everywhere."""
    assert str(spec["rayVersion"]) == RAY_VERSION, f"{where}: rayVersion != RAY_VERSION in cluster/Dockerfile"
    assert spec["authOptions"] == {"mode": "token"}, f"{where}: Ray token authentication (KubeRay authOptions)"
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP", f"{where}: the head's ports off any public address"
    groups = [("headGroupSpec", spec["headGroupSpec"])]
    assert spec["workerGroupSpecs"], f"{where}: no workerGroupSpecs"
    groups += [(f"workerGroupSpecs[{g['groupName']}]", g) for g in spec["workerGroupSpecs"]]
    gpu_groups, cpu_groups = [], []
    for name, group in groups:
        params = group["rayStartParams"]
        assert isinstance(params, dict) and all(isinstance(v, str) for v in params.values()), (
            f"{where}: {name}.rayStartParams must map to strings"
        )
        containers = group["template"]["spec"]["containers"]
        assert containers, f"{where}: {name} has no containers"
        for container in containers:
            assert container["name"] and container["image"] == TEST_VALUES["IMAGE"], f"{where}: {name} image"
            assert container["resources"]["limits"] and container["resources"]["requests"], (
                f"{where}: {name} needs resources.limits and resources.requests"
            )
            if "nvidia.com/gpu" in container["resources"]["limits"]:
                gpu_groups.append(name)
                assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
            elif name != "headGroupSpec":
                cpu_groups.append(name)
                assert int(container["resources"]["requests"]["cpu"]) >= 16, f"{where}: {name}: cores for decoding"
                assert group["minReplicas"] == int(TEST_VALUES["CPU_WORKERS"]), (
                    f"{where}: {name} starts with the cluster"
                )
        if name != "headGroupSpec":
            counts = [group["minReplicas"], group["replicas"], group["maxReplicas"]]
            assert all(isinstance(n, int) for n in counts) and counts == sorted(counts), (
                f"{where}: {name}: minReplicas <= replicas <= maxReplicas, got {counts}"
            )
    assert gpu_groups and "headGroupSpec" not in gpu_groups, f"{where}: GPUs belong to a worker group"
    assert len(cpu_groups) == 1, f"{where}: one CPU-only worker group for Ray Data, got {cpu_groups}"


def test_raycluster_has_cpu_head_and_gpu_workers():
    cluster = by_kind(load(KUBERAY / "raycluster.yaml"))["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"]
    check_ray_cluster_spec(cluster["spec"], "raycluster.yaml")


@pytest.mark.parametrize("where", list(rayjobs()))
def test_rayjobs_submit_an_entrypoint_to_their_own_cluster(where):
    job = rayjobs()[where]
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"].get("name") or job["metadata"].get("generateName"), f"{where}: metadata.name"
    spec = job["spec"]
    assert isinstance(spec["entrypoint"], str) and spec["entrypoint"].startswith("mdc ")
    assert spec["submissionMode"] in SUBMISSION_MODES
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    check_ray_cluster_spec(spec["rayClusterSpec"], where)


def test_cronjob_creates_the_rayjob_with_just_enough_rights():
    docs = by_kind(load(KUBERAY / "scaling-cronjob.yaml"))
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "CronJob"}
    cron = docs["CronJob"]
    assert cron["apiVersion"] == "batch/v1" and len(cron["spec"]["schedule"].split()) == 5
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    account = docs["ServiceAccount"]["metadata"]["name"]
    assert pod["serviceAccountName"] == account
    binding = docs["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]} in docs["Role"]["rules"]
    [container] = pod["containers"]
    assert container["image"] == TEST_VALUES["KUBECTL_IMAGE"]
    command = container["command"]
    assert command[:3] == ["kubectl", "create", "-f"]
    [mount] = container["volumeMounts"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert command[3] == f"{mount['mountPath']}/rayjob.yaml" and "rayjob.yaml" in docs["ConfigMap"]["data"]
    # weekly schedule ("m h * * weekday"); a run is cut off before the next one starts
    assert cron["spec"]["schedule"].split()[2:4] == ["*", "*"]
    assert scheduled_rayjob()["spec"]["activeDeadlineSeconds"] < 7 * 24 * 3600


# ------------------------------------------------------------------------------ cluster launcher


def test_aws_cluster_launcher_config_matches_rays_schema():
    [config] = load(CLUSTER / "aws" / "cluster.yaml")
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] == "aws" and config["provider"]["region"] == TEST_VALUES["AWS_REGION"]
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert isinstance(config["max_workers"], int)
    assert set(types) == {config["head_node_type"], "gpu", "gpu_spot", "cpu"}
    gpu, spot, cpu = types["gpu"], types["gpu_spot"], types["cpu"]
    assert gpu["node_config"]["InstanceType"] == spot["node_config"]["InstanceType"] == TEST_VALUES["GPU_INSTANCE_TYPE"]
    assert spot["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"} and "InstanceMarketOptions" not in gpu
    assert spot["min_workers"] == 0 and spot["max_workers"] == int(TEST_VALUES["SPOT_GPU_WORKERS"])
    assert cpu["node_config"]["InstanceType"] == TEST_VALUES["CPU_INSTANCE_TYPE"]
    assert cpu["min_workers"] == cpu["max_workers"] == int(TEST_VALUES["CPU_WORKERS"])  # up before training
    assert gpu["max_workers"] + spot["max_workers"] + cpu["max_workers"] <= config["max_workers"]
    assert config["docker"]["image"] == TEST_VALUES["IMAGE"]


def test_aws_cluster_runs_token_auth_from_a_secret_and_keeps_the_dashboard_local():
    """Every node starts Ray with RAY_AUTH_MODE=token and the token read from the Secrets Manager
    secret the user creates (never written in the file); the dashboard listens on 127.0.0.1."""
    [config] = load(CLUSTER / "aws" / "cluster.yaml")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [start] = [command for command in config[key] if "ray start" in command]
        assert "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN" in start, key
        assert "get_secret_value(SecretId='mdc-ray-token')" in start and "region_name='us-west-2'" in start, key
        assert start.index("RAY_AUTH_TOKEN=$(") < start.index("ray start"), key
    [head] = [command for command in config["head_start_ray_commands"] if "ray start" in command]
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in json.dumps(config)


# -------------------------------------------------------------------------- agreement with the CLI


def cli_options(command: str) -> set[str]:
    click_command = typer.main.get_command(app).commands[command]
    return {opt for param in click_command.params for opt in param.opts + param.secondary_opts}


@pytest.mark.parametrize("where", list(rayjobs()))
def test_entrypoints_name_real_commands_options_and_fields(where):
    tokens = shlex.split(rayjobs()[where]["spec"]["entrypoint"])
    assert tokens[0] == "mdc"
    command = tokens[1]
    help_result = CliRunner().invoke(app, [command, "--help"])
    assert help_result.exit_code == 0, f"{where}: `mdc {command}` is not a command"
    options = cli_options(command)
    for token in tokens[2:]:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in options, f"{where}: `mdc {command}` has no option {token}"
    config = repo_path(tokens[tokens.index("--config") + 1])
    assert config.is_file(), f"{where}: --config {config} is not in the repository"
    overrides = [t for t in tokens[2:] if "=" in t and not t.startswith("-")]
    load_config(config, overrides)  # every override names a real config field with a valid value


def test_every_config_path_in_cluster_files_exists():
    for path in [*YAMLS, CLUSTER / "Dockerfile"]:
        for config in re.findall(r"--config[ =](\S+)", path.read_text()):
            assert repo_path(config).is_file(), f"{path}: --config {config} is not in the repository"
    for config in CLUSTER.glob("configs/*.yaml"):
        load_config(config)
