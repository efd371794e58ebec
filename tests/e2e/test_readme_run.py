"""The README's run command, as a new user runs it: fresh directory, fresh database, demo assets built,
a demo key printed once and working against `serve run serve_config.yaml`; stopped with SIGTERM, cleanly
(exit status 0) and quietly, `serve run` and its local cluster with it. Started as a script's background
job (`loraplex up &`: SIGINT ignored), the harder case: `serve run` used to inherit the ignored SIGINT,
and SIGTERM to `up` then stopped nothing."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.app.conftest import free_port
from tests.app.test_up_stops import ignore_sigint
from tests.processes import gone_within

ROOT = Path(__file__).resolve().parents[2]
# What stopping and starting used to print that no operator acts on: torchao's CUDA extension lines and
# pytree warnings, GPT-QModel's banner, transformers' deprecation warnings, Ray's native SIGTERM trace.
NOISE = ("Failed to load", "_pytree", "GPT-QModel", "FutureWarning", "SIGTERM received", "logging.cc")


@pytest.mark.slow
def test_loraplex_up_serves_with_the_printed_key(tmp_path: Path) -> None:
    shutil.copy(ROOT / "serve_config.yaml", tmp_path / "serve_config.yaml")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    # This test session already runs a Ray cluster; a new user's `serve run` starts its own.
    env["RAY_ADDRESS"] = "local"
    loraplex = Path(sys.executable).parent / "loraplex"
    log = (tmp_path / "up.log").open("w")
    process = subprocess.Popen([str(loraplex), "up", "--port", str(port)], cwd=tmp_path, env=env,
                               stdout=log, stderr=subprocess.STDOUT, preexec_fn=ignore_sigint)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        else:
            pytest.fail("the platform did not come up:\n" + (tmp_path / "up.log").read_text()[-3000:])
        output = (tmp_path / "up.log").read_text()
        found = re.search(r"LORAPLEX_DEMO_KEY=(\S+)", output)
        assert found is not None, output[-3000:]
        key = found.group(1)
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        assert "demo-llama" in [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model="demo-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        assert "public/demo-sql" in [m.id for m in client.models.list().data]  # the demo adapters serve too
        adapted = client.chat.completions.create(
            model="public/demo-sql", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert adapted.usage is not None and adapted.usage.completion_tokens >= 1
        assert (tmp_path / "var" / "loraplex.db").exists()  # the embedded defaults, in the new directory
        assert (tmp_path / "var" / "models" / "demo-llama" / "config.json").exists()
        bad = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer sk-lp-nope"})
        assert bad.status_code == 401
        tree = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]  # serve run, Ray
        assert len(tree) > 3, tree
        process.send_signal(signal.SIGTERM)  # as an operator's `kill`, or a service manager, stops it
        assert process.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert gone_within(tree, 30) == [], "processes of `serve run` outlived `up`"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # `serve run` gets SIGINT when its parent dies
            process.wait()
        log.close()
    output = (tmp_path / "up.log").read_text()
    noise = [n for n in NOISE if n in output]
    assert not noise, f"operator output carries {noise}:\n{output[-3000:]}"
