"""The adapter store by URL: what a node pays to read a version from S3 (moto's server over HTTP, on this
host) against its node cache, and against a local directory store.

Timed per version (median over --repeats versions, each of one adapter_model.safetensors of --mb MiB):
- upload: `put_dir` to S3 (claim, two files, manifest).
- cold: `path(ref)` on an empty node cache: the manifest, the files, sha256 of each, the rename.
- hit_fresh: `path(ref)` in a new cache object (a replica just started): sizes and sha256 re-checked.
- hit: `path(ref)` again in the same process (verified files unchanged since: no hashing).
- local: `path(ref)` of a file:// store (no copy, no hash).
moto is in-process and local, so `cold` is a floor; a real S3 adds its network round trips and bandwidth.
Each version is one round of all five, back to back (the order is fixed: a hit needs the cold read first);
the ratio cold/hit_fresh is taken per round and reported as its median and spread.

Run:  python -m bench.adapter_store [--tiny] [--mb 64] [--repeats 5]
The last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
from moto.server import ThreadedMotoServer

from adapters.node_cache import NodeCache
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.store import AdapterStore
from bench.measure import machine, spread


def timed(times: list[float], action: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = action()
    times.append((time.perf_counter() - start) * 1000)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="1 MiB versions, 2 repeats (a smoke run)")
    parser.add_argument("--mb", type=float, default=64.0, help="size of each version's weights file")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mb, repeats = (1.0, 2) if args.tiny else (args.mb, args.repeats)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        with tempfile.TemporaryDirectory() as scratch:
            result = run(Path(scratch), mb, repeats)
    finally:
        server.stop()
    print(json.dumps(result))


def run(scratch: Path, mb: float, repeats: int) -> dict[str, Any]:
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
    store = AdapterStore("s3://bench/adapters", cache_dir=scratch / "cache", cache_max_bytes=2**40)
    local = AdapterStore(scratch / "local")
    times: dict[str, list[float]] = {k: [] for k in ("upload", "cold", "hit_fresh", "hit", "local")}
    for i in range(repeats):
        src = scratch / f"src{i}"
        src.mkdir()
        (src / CONFIG_FILE).write_text('{"peft_type": "LORA"}')
        (src / WEIGHTS_FILE).write_bytes(os.urandom(int(mb * 2**20)))
        ref: AdapterRef = timed(times["upload"], partial(store.put_dir, src.name, src))
        local_ref = local.put_dir(src.name, src)
        timed(times["cold"], partial(store.path, ref))
        store.cache = NodeCache(scratch / "cache", 2**40)  # what a replica that just started has
        timed(times["hit_fresh"], partial(store.path, ref))
        timed(times["hit"], partial(store.path, ref))
        timed(times["local"], partial(local.path, local_ref))
    medians = {f"{k}_ms": round(statistics.median(v), 3) for k, v in times.items()}
    ratio = spread([c / max(h, 1e-3) for c, h in zip(times["cold"], times["hit_fresh"], strict=True)])
    return {
        "mb": mb,
        "repeats": repeats,
        **medians,
        "cold_mb_s": round(mb / (medians["cold_ms"] / 1000), 1),
        "ratio_cold_vs_hit_fresh": round(ratio["median"], 1),
        "ratio_cold_vs_hit_fresh_spread": ratio,
        "machine": machine(),
    }


if __name__ == "__main__":
    main()
