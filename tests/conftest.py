"""Shared fixtures (a real S3 API with dummy credentials, one local Ray, tiny datasets) and the CI
rules: a test that uses Ray is marked `ray`, and under CI=true a skip of any kind (a test's, or a
module's while collected) fails the run."""

import logging
import os
from dataclasses import dataclass

import boto3
import pytest
from helpers import LOCAL_RAY
from moto.server import ThreadedMotoServer

from pipelines.infra.console import Settings

pytest_plugins = ["pytester"]  # tests/test_ci_rules.py runs these hooks on a throwaway suite

DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts Ray, however it gets the cluster (directly or through a fixture),
    so that `-m "not ray"` leaves exactly the Ray-free tests."""
    for item in items:
        if {"ray_cluster", "multinode", "one_trainer_node"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On CI a skip is a failure: a missing system package must not turn a test into a green dot."""
    report = yield
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} was skipped on CI ({reason}); install what it needs (.ci/run)"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """On CI a module that skips itself while collected (`pytest.importorskip`, a module-level
    `pytest.skip`) fails too: its tests would otherwise vanish from the count without a skip line."""
    report = yield
    if report.skipped and os.environ.get("CI") == "true":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} was skipped on CI ({reason}); install what it needs (.ci/run)"
    return report


@dataclass
class S3Server:
    endpoint_url: str

    def make_bucket(self, name: str) -> str:
        """Create a bucket (names need >= 3 characters) and return its s3:// URI."""
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(autouse=True)
def console_settings_reset(monkeypatch):
    """`--verbose` sets a process-wide switch (full tracebacks on the console): a command a test runs
    in-process must not leave it on for the next test in that process."""
    monkeypatch.setattr(Settings, "verbose", False)


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible endpoint for the whole test session; AWS_* are dummies while it runs, and no
    real credentials or endpoint variables leak in."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in DUMMY_AWS_ENV.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield S3Server(f"http://{host}:{port}")
        finally:
            server.stop()


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One local Ray instance (2 logical CPUs) for the session, started after the S3 credentials
    are in the environment so that its workers inherit them, with Ray's token authentication as
    `mdc` starts it (ray.init turns it on and sets RAY_AUTH_MODE=token for the session)."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(**LOCAL_RAY)
        yield
        ray.shutdown()


@pytest.fixture
def ray_forbidden(monkeypatch):
    """For tests that say a command fails before Ray: starting Ray raises, so a check that moved
    after ray.init shows up as this error instead of the expected one."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called before the error was reported")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small shapes dataset on local disk (train/, val/, compositionality/)."""
    from mdc.data.shapes import write_shapes_dataset

    root = tmp_path_factory.mktemp("shapes")
    write_shapes_dataset(str(root), num=240, seed=0, samples_per_shard=60)
    return root


@pytest.fixture(scope="session")
def cifar10_dir(tmp_path_factory):
    """CIFAR-10's python batches (torchvision's layout): 50 training and 20 test images."""
    from helpers import write_cifar10

    return write_cifar10(tmp_path_factory.mktemp("cifar10") / "cifar-10-batches-py")


@pytest.fixture(scope="session")
def img2dataset_dir(tmp_path_factory):
    """An img2dataset webdataset folder (no labels, no splits): 64 captioned 32-px shapes in 2 shards."""
    from mdc.data.img2dataset import generated_rows, write_img2dataset_folder

    root = tmp_path_factory.mktemp("img2dataset")
    write_img2dataset_folder(generated_rows(64, image_size=32, failed_every=0), str(root), "webdataset", 32)
    return root


@pytest.fixture(scope="session")
def untrained_checkpoint(tmp_path_factory):
    """An exported tiny checkpoint at random init, as training writes one: for tests of plumbing, not quality."""
    from mdc.config import RunConfig, dump_config
    from mdc.evaluation import probe
    from mdc.training.checkpoint import export_weights

    cfg = RunConfig.model_validate({"data": {"max_length": 16}})
    directory = tmp_path_factory.mktemp("checkpoint") / "checkpoint_00000010"
    export_weights(directory, probe.random_init(cfg, seed=0).state_dict(), dump_config(cfg))
    return directory


@pytest.fixture(scope="module")
def gloo_process_group(tmp_path_factory):
    """A one-process gloo group for a test module (DCP, FSDP2 and their collectives need one)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
