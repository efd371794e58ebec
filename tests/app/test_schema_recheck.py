"""A database whose schema goes away under a running replica (recreated empty, restored from an old dump):
once a statement fails as a missing table does, calls and /readyz name the revision found and the fix
instead of answering "database unavailable" for ever (issue 14, item 9: re-checked on a database error)."""

import time
from pathlib import Path

import httpx

from billing.migrate import downgrade, head
from tests.app.bare_serving import bare_serving
from tests.model_fixtures import TinySetup

FIX = "loraplex db upgrade"


def test_a_schema_dropped_while_serving_is_reported_as_not_migrated(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path) as bare:
        with bare.admin() as admin:
            assert admin.get("/admin/tenants").status_code == 200  # the gate has seen head
            downgrade(bare.database_url, "base")  # every table gone
            time.sleep(1.1)  # past the gate's recheck interval
            first = admin.get("/admin/tenants")
            assert first.status_code == 503, first.text  # the statement that found no table
            deadline = time.monotonic() + 5
            while (r := admin.get("/admin/tenants")).json()["error"]["code"] != "database_not_migrated":
                assert time.monotonic() < deadline, r.text  # before: database_unavailable, for ever
                time.sleep(0.2)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and FIX in message and head() in message, message
        ready = httpx.get(f"{bare.url}/readyz", timeout=30)
        assert ready.status_code == 503, ready.text
        assert FIX in ready.json()["checks"]["database"]
