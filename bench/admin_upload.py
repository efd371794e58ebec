"""post_adapter: POST /admin/adapters with an adapter directory's two files, the way the admin API takes
them. The benches and the tests that upload adapters over HTTP share this one copy."""

from pathlib import Path

import httpx

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def post_adapter(
    admin: httpx.Client, name: str, owner: str, source: Path, base_model: str | None = None
) -> httpx.Response:
    """`admin` carries the admin key; `owner` is a tenant id or "public"; the response as it came."""
    data = {"name": name, "owner": owner, **({"base_model": base_model} if base_model else {})}
    files = {
        "adapter_config": (CONFIG_FILE, (source / CONFIG_FILE).read_bytes()),
        "adapter_model": (WEIGHTS_FILE, (source / WEIGHTS_FILE).read_bytes()),
    }
    return admin.post("/admin/adapters", data=data, files=files)
