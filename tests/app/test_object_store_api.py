"""The platform on an S3 adapter store (moto's server over HTTP, s3fs as in production), through HTTP:
an upload is servable at once and equals PEFT; with the store gone, uploads answer 503 and leave nothing
behind while adapters already in the engine's node cache keep serving."""

import logging
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from openai import OpenAI

from app.bootstrap import build_services
from app.main import create_app
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from bench.live_server import LiveServer
from deployments.engine.interface import LocalEngineClient
from tests.adapters.s3_proxy import s3_proxy
from tests.app.conftest import ADMIN_KEY, MODEL, Served, serving
from tests.app.test_adapters_api import greedy, reference_text, upload_files
from tests.app.test_files_api import jsonl, line
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

BUCKET = "loraplex-adapters"


@pytest.fixture(scope="module")
def s3(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[ThreadedMotoServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_MAX_ATTEMPTS": "1",  # the outage below fails at once instead of retrying
    }.items():
        monkeypatch_module.setenv(name, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def on_s3(
    llama: TinySetup, tmp_path_factory: pytest.TempPathFactory, s3: ThreadedMotoServer
) -> Iterator[Served]:
    with serving(llama, tmp_path_factory.mktemp("s3-app"), store=f"s3://{BUCKET}/prod") as app:
        yield app


def test_files_and_batches_keep_their_bytes_in_the_object_store(
    on_s3: Served, s3: ThreadedMotoServer
) -> None:
    """The Files API's bytes go to the adapter store's bucket under its `.files/` prefix: uploaded,
    read back for a batch and for the client, and removed on delete. (First: the outage test below
    restarts the store on another port.)"""
    tenant_id, key = on_s3.new_tenant(f"s3-files-{uuid.uuid4().hex[:8]}")
    client = OpenAI(base_url=f"{on_s3.url}/v1", api_key=key, max_retries=0)
    content = jsonl([line("a"), line("b")])
    created = client.files.create(file=("in.jsonl", content), purpose="batch")
    host, port = s3.get_host_and_port()
    bucket = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    key_name = f"prod/.files/{tenant_id}/{created.id}.jsonl"
    assert bucket.get_object(Bucket=BUCKET, Key=key_name)["Body"].read() == content
    assert client.files.content(created.id).read() == content
    batch = client.batches.create(
        input_file_id=created.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert (
        batch.status == "in_progress" and batch.request_counts is not None and batch.request_counts.total == 2
    )
    assert client.files.delete(created.id).deleted
    listed = bucket.list_objects_v2(Bucket=BUCKET, Prefix=f"prod/.files/{tenant_id}/")
    # The batch may have finished meanwhile: its output file is the tenant's too, and stays.
    assert key_name not in [item["Key"] for item in listed.get("Contents", [])]


def test_uploads_serve_from_the_store_and_outlive_its_outage(on_s3: Served, s3: ThreadedMotoServer) -> None:
    tenant_id, key = on_s3.new_tenant(f"s3-{uuid.uuid4().hex[:8]}")
    response = upload_files(on_s3, "sql", tenant_id, on_s3.setup.adapter_dirs["demo-sql"])
    assert response.status_code == 201, response.text
    reference = PeftReference(on_s3.setup.model_dir, on_s3.setup.adapter_dirs)
    client = OpenAI(base_url=f"{on_s3.url}/v1", api_key=key, max_retries=0)
    expected = reference_text(on_s3, reference, "demo-sql")
    assert greedy(client, "sql") == expected
    cached = list(Path(on_s3.data_dir / "engine-cache").rglob("adapter_model.safetensors"))
    assert cached, "the engine read the version through its node cache"

    s3.stop()  # the object store goes away
    try:
        refused = upload_files(on_s3, "poet", tenant_id, on_s3.setup.adapter_dirs["demo-poet"])
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_store_unavailable" and "s3://" not in error["message"]
        with on_s3.admin() as admin:
            names = [
                a["name"] for a in admin.get("/admin/adapters", params={"owner": tenant_id}).json()["data"]
            ]
        assert names == ["sql"], "a refused upload leaves no adapter behind"
        assert greedy(client, "sql") == expected  # served from the engine's tiers and node cache
    finally:
        s3.start()


def test_the_ingress_keeps_its_node_cache_where_configured(on_s3: Served) -> None:
    """It used the per-user default under /tmp, a path anyone could plant a link at beforehand."""
    cache = on_s3.services.store.cache
    assert cache is not None and cache.root == on_s3.data_dir / "ingress-cache"
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700


def test_uploads_to_a_store_that_creates_one_object_twice_are_refused(
    on_s3: Served,
    s3: ThreadedMotoServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ingress starting on such a store says why in its log; an upload then gets a 503 that says uploads
    are off, with no internals, and leaves nothing behind. Serving is unaffected."""
    tenant_id, _ = on_s3.new_tenant(f"unsafe-{uuid.uuid4().hex[:8]}")
    host, port = s3.get_host_and_port()  # restarted by the outage test: maybe on another port
    with s3_proxy(f"http://{host}:{port}", conditional_creates=False) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        settings = Settings(
            data_dir=tmp_path,
            database_url=f"sqlite:///{on_s3.data_dir / 'loraplex.db'}",
            admin_key=ADMIN_KEY,
            adapter_store=f"s3://{BUCKET}/prod",
            adapter_cache_dir=tmp_path / "cache",
        )
        with caplog.at_level(logging.ERROR):
            services = build_services(
                settings,
                LocalEngineClient({MODEL: on_s3.engine}),
                {MODEL: BaseModelSpec(on_s3.setup.model_dir)},
            )
        assert "refuses uploads" in caplog.text and "created twice" in caplog.text
        with LiveServer(create_app(services)) as server:
            ingress = Served(server.url, on_s3.engine, services, on_s3.setup, tmp_path)
            refused = upload_files(ingress, "sql", tenant_id, on_s3.setup.adapter_dirs["demo-sql"])
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_uploads_disabled" and "s3://" not in error["message"]
    assert "retry-after" not in refused.headers  # it stays refused until the operator changes the store
    with on_s3.admin() as admin:
        assert admin.get("/admin/adapters", params={"owner": tenant_id}).json()["data"] == []
