"""The adapter store over S3 (moto's server, spoken to over HTTP by s3fs, as in production) and the node
cache in front of it: versions, tombstones, racing writers, half-written versions, the cache's fetch-once,
LRU bound, corruption and wipe, and the store going away."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote

import fsspec
import pytest
from moto.server import ThreadedMotoServer

from adapters.errors import AdapterLoadFailed, AdapterNotFound, AdapterStoreUnavailable, AdapterStoreUnsafe
from adapters.manifest import MANIFEST_FILE, Manifest, content_key, digest_file
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.store import AdapterStore, store_location
from billing import adapter_registry
from billing.adapter_digests import RegistryDigests
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from tests.adapters.s3_proxy import s3_proxy

ROOT = Path(__file__).resolve().parents[2]
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_MAX_ATTEMPTS": "1",  # a stopped server fails at once
}


def start_server() -> tuple[ThreadedMotoServer, str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server, url = start_server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**AWS_ENV, "AWS_ENDPOINT_URL": url}.items():
            patch.setenv(name, value)
        yield url
    server.stop()


@pytest.fixture
def url(endpoint: str) -> str:
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/store"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_src(tmp_path / "src", os.urandom(64 * 1024))


def make_src(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text('{"peft_type": "LORA"}')
    (path / WEIGHTS_FILE).write_bytes(weights)
    return path


def raw(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    return fs, root


def open_store(url: str, cache: Path, max_bytes: int = 2**30) -> AdapterStore:
    return AdapterStore(url, cache_dir=cache, cache_max_bytes=max_bytes)


def test_locations() -> None:
    assert store_location("/srv/adapters") == Path("/srv/adapters")
    assert store_location("file:///srv/adapters") == Path("/srv/adapters")
    assert store_location("relative/dir") == Path("relative/dir")
    assert store_location("s3://bucket/prefix") == "s3://bucket/prefix"
    with pytest.raises(ValueError, match="this machine"):
        store_location("file://otherhost/srv")


def test_a_file_url_is_the_local_directory_store(tmp_path: Path, src: Path) -> None:
    store = AdapterStore(f"file://{tmp_path}/store")
    ref = store.put_dir("a", src)
    assert store.path(ref) == tmp_path / "store" / "a" / "v1"  # read in place: no cache, no copy
    assert store.cache is None


def test_put_read_list_latest_and_delete(url: str, src: Path, tmp_path: Path) -> None:
    store = open_store(url, tmp_path / "cache")
    assert store.versions("a") == []
    assert store.put_dir("a", src) == AdapterRef("a", 1)
    assert store.put_dir("a", src) == AdapterRef("a", 2)
    assert store.put_dir("b", src) == AdapterRef("b", 1)
    assert store.versions("a") == [1, 2]
    assert store.latest("a") == AdapterRef("a", 2)
    path = store.path(AdapterRef("a", 1))
    assert path.is_relative_to(tmp_path / "cache")
    assert (path / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["files"][WEIGHTS_FILE]["size"] == 64 * 1024

    fs, root = raw(url)
    store.delete_version(AdapterRef("a", 1))
    assert fs.exists(f"{root}/a/v1.deleted")
    assert fs.find(f"{root}/a/v1/") == []
    assert store.versions("a") == [2]
    assert not AdapterStore(url, cache_dir=tmp_path / "other-cache").exists(AdapterRef("a", 1))
    assert store.put_dir("a", src) == AdapterRef("a", 3)  # numbers are never reused
    with pytest.raises(AdapterNotFound):
        store.delete_version(AdapterRef("a", 1))

    store.delete("a")
    assert store.versions("a") == []
    with pytest.raises(AdapterNotFound):
        store.latest("a")
    with pytest.raises(AdapterNotFound):
        open_store(url, tmp_path / "fresh").path(AdapterRef("a", 3))
    assert store.versions("b") == [1]


def test_concurrent_puts_from_threads_get_distinct_versions(url: str, tmp_path: Path) -> None:
    writers = 8
    sources = [make_src(tmp_path / f"src{i}", os.urandom(4096)) for i in range(writers)]
    store = open_store(url, tmp_path / "cache")
    barrier = threading.Barrier(writers)

    def put(i: int) -> AdapterRef:
        barrier.wait()  # all race for v1
        return store.put_dir("race", sources[i])

    with ThreadPoolExecutor(writers) as pool:
        refs = list(pool.map(put, range(writers)))
    assert sorted(ref.version for ref in refs) == list(range(1, writers + 1))
    assert store.versions("race") == list(range(1, writers + 1))
    for i, ref in enumerate(refs):  # nobody's bytes were overwritten by another writer
        assert (store.path(ref) / WEIGHTS_FILE).read_bytes() == (sources[i] / WEIGHTS_FILE).read_bytes()


PUT_SCRIPT = """
import sys, os
from pathlib import Path
from adapters.store import AdapterStore
store = AdapterStore(sys.argv[1], cache_dir=Path(sys.argv[2]))
src = Path(sys.argv[3])
for _ in range(int(sys.argv[4])):
    print(store.put_dir("race", src).version, flush=True)
"""


def test_concurrent_puts_from_two_processes(url: str, tmp_path: Path) -> None:
    sources = [make_src(tmp_path / f"src{i}", os.urandom(4096)) for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PUT_SCRIPT, url, str(tmp_path / "cache"), str(source), "3"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for source in sources
    ]
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    versions = [[int(line) for line in out.split()] for out in outputs]
    assert sorted(versions[0] + versions[1]) == list(range(1, 7))
    store = open_store(url, tmp_path / "reader")
    for source, mine in zip(sources, versions, strict=True):
        for version in mine:
            path = store.path(AdapterRef("race", version))
            assert (path / WEIGHTS_FILE).read_bytes() == (source / WEIGHTS_FILE).read_bytes()


def test_a_version_without_its_manifest_is_invisible_and_swept(url: str, src: Path, tmp_path: Path) -> None:
    fs, root = raw(url)
    fs.pipe_file(f"{root}/.uploads/a/v1", b"")  # a writer killed before its manifest
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        fs.put_file(str(src / name), f"{root}/a/v1/{name}")
    store = open_store(url, tmp_path / "cache")
    assert store.versions("a") == []
    assert not store.exists(AdapterRef("a", 1))
    with pytest.raises(AdapterNotFound):
        store.path(AdapterRef("a", 1))
    assert store.put_dir("a", src) == AdapterRef("a", 2)  # v1 counts as taken
    assert store.cleanup_tmp(max_age_s=3600) == 0  # still fresh: maybe a writer at work
    assert store.cleanup_tmp(max_age_s=0) == 1
    assert fs.find(f"{root}/a/v1/") == []
    assert fs.find(f"{root}/.uploads/") == []  # its marker went with it, and v2's after its upload
    assert store.versions("a") == [2]


def test_the_sweep_lists_only_the_stores_uploads_and_touches_nothing_else(
    endpoint: str, url: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket may hold anything beside the store, even under its prefix; the sweep used to list all of
    it and remove whatever looked like `<x>/v<N>/...` without a manifest."""
    fs, root = raw(url)
    bucket = root.split("/")[0]
    strangers = [f"{bucket}/other-app/v1/data.csv", f"{root}/notes/v2/draft.txt"]
    for key in strangers:
        fs.pipe_file(key, b"not ours")
    fs.pipe_file(f"{root}/.uploads/a/v1", b"")  # one upload a killed writer left
    fs.put_file(str(src / CONFIG_FILE), f"{root}/a/v1/{CONFIG_FILE}")
    with s3_proxy(endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert open_store(url, tmp_path / "cache").cleanup_tmp(max_age_s=0) == 1
    listed = [unquote(path) for method, path in proxy.requests if method == "GET" and "list-type" in path]
    assert listed and all("prefix=store/.uploads/" in p or "prefix=store/a/v1/" in p for p in listed), listed
    assert all(fs.exists(key) for key in strangers)
    assert fs.find(f"{root}/a/") == [] and fs.find(f"{root}/.uploads/") == []


def test_a_store_that_creates_one_object_twice_refuses_uploads(
    endpoint: str, url: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers could claim one version number there and overwrite each other's files."""
    root = raw(url)[1]
    with s3_proxy(endpoint, conditional_creates=False) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ignoring, _ = raw(url)
        ignoring.pipe_file(f"{root}/twice", b"1", mode="create")
        ignoring.pipe_file(f"{root}/twice", b"2", mode="create")  # what the check finds: no refusal
        store = open_store(url, tmp_path / "cache")
        assert store.check_writes() is not None
        with pytest.raises(AdapterStoreUnsafe, match="created twice"):
            store.put_dir("a", src)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the same bucket, spoken to directly: it refuses
    fs = raw(url)[0]
    assert fs.find(f"{root}/a") == [] and fs.find(f"{root}/.probes") == []  # nothing claimed, no probe left
    honest = open_store(url, tmp_path / "cache")
    assert honest.check_writes() is None
    assert honest.put_dir("a", src) == AdapterRef("a", 1)


def test_files_that_do_not_match_their_manifest_are_refused(url: str, src: Path, tmp_path: Path) -> None:
    store = open_store(url, tmp_path / "cache")
    ref = store.put_dir("a", src)
    fs, root = raw(url)
    fs.pipe_file(f"{root}/a/v1/{WEIGHTS_FILE}", os.urandom(64 * 1024))  # same size, other bytes
    with pytest.raises(AdapterLoadFailed, match="sha256"):
        store.path(ref)
    fs.pipe_file(f"{root}/a/v1/{WEIGHTS_FILE}", b"short")
    with pytest.raises(AdapterLoadFailed, match="bytes"):
        store.path(ref)
    assert store.cache is not None
    assert store.cache.total_bytes() == 0  # nothing unverified entered the cache


READ_SCRIPT = """
import sys, time
from pathlib import Path
from adapters.ref import AdapterRef
from adapters.store import AdapterStore
store = AdapterStore(sys.argv[1], cache_dir=Path(sys.argv[2]))
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
path = store.path(AdapterRef("a", 1))
print(store.cache.fetches, len((path / "adapter_model.safetensors").read_bytes()), flush=True)
"""


def test_two_processes_reading_one_version_fetch_it_once(url: str, tmp_path: Path) -> None:
    src = make_src(tmp_path / "src", os.urandom(4 * 2**20))
    open_store(url, tmp_path / "writer-cache").put_dir("a", src)
    start = time.time() + 2.0  # both past their imports, then racing
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READ_SCRIPT, url, str(tmp_path / "cache"), str(start)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=60)[0].split() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert sorted(int(fetches) for fetches, _ in results) == [0, 1]
    assert all(int(size) == 4 * 2**20 for _, size in results)
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


def test_the_cache_evicts_least_recently_used_past_its_bound(url: str, tmp_path: Path) -> None:
    size = 100_000
    writer = open_store(url, tmp_path / "writer-cache")
    refs = {
        name: writer.put_dir(name, make_src(tmp_path / name, os.urandom(size))) for name in ("a", "b", "c")
    }
    store = open_store(url, tmp_path / "cache", max_bytes=int(2.5 * size))
    assert store.cache is not None
    a = store.path(refs["a"])
    b = store.path(refs["b"])
    os.utime(b, (time.time() - 60, time.time() - 60))  # b used long ago...
    assert store.path(refs["a"]) == a  # ...a just now (a hit)
    assert store.cache.fetches == 2
    c = store.path(refs["c"])
    assert a.exists() and c.exists() and not b.exists()
    assert store.cache.total_bytes() <= 2.5 * size
    assert store.path(refs["b"]).exists()  # fetched again on demand
    assert store.cache.fetches == 4


def test_a_corrupted_or_wiped_cache_is_fetched_again(url: str, src: Path, tmp_path: Path) -> None:
    store = open_store(url, tmp_path / "cache")
    assert store.cache is not None
    ref = store.put_dir("a", src)
    good = (src / WEIGHTS_FILE).read_bytes()
    path = store.path(ref)
    assert store.path(ref) == path and store.cache.fetches == 1
    with (path / WEIGHTS_FILE).open("r+b") as f:  # one flipped byte: same size, other sha256
        f.write(bytes([good[0] ^ 0xFF]))
    path = store.path(ref)
    assert (path / WEIGHTS_FILE).read_bytes() == good and store.cache.fetches == 2
    (path / WEIGHTS_FILE).write_bytes(good[:100])  # truncated
    path = store.path(ref)
    assert (path / WEIGHTS_FILE).read_bytes() == good and store.cache.fetches == 3
    shutil.rmtree(tmp_path / "cache")  # wiped while serving
    path = store.path(ref)
    assert (path / WEIGHTS_FILE).read_bytes() == good and store.cache.fetches == 4


def test_store_unreachable_fails_uploads_while_cached_versions_still_load(
    endpoint: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, own = start_server()
    monkeypatch.setenv("AWS_ENDPOINT_URL", own)
    try:
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("doomed")
        store = open_store("s3://doomed/store", tmp_path / "cache")
        cached = store.put_dir("a", src)
        uncached = store.put_dir("a", src)
        store.path(cached)
    finally:
        server.stop()
    began = time.monotonic()
    with pytest.raises(AdapterStoreUnavailable, match="s3://doomed/store is unavailable"):
        store.put_dir("a", src)
    assert time.monotonic() - began < 20
    assert store.exists(cached)
    assert (store.path(cached) / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
    with pytest.raises(AdapterStoreUnavailable):
        store.path(uncached)
    with pytest.raises(AdapterStoreUnavailable):
        store.versions("a")
    # A fresh replica on the same node serves what the node cached, still without the store.
    assert open_store("s3://doomed/store", tmp_path / "cache").path(cached).is_dir()


def test_a_missing_bucket_is_the_store_failing(url: str, src: Path, tmp_path: Path) -> None:
    store = open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", tmp_path / "cache")
    with pytest.raises(AdapterStoreUnavailable):
        store.put_dir("a", src)


def test_checking_a_version_fetches_its_config_not_its_weights(url: str, src: Path, tmp_path: Path) -> None:
    """The engine checks a version on its loop thread: that must not wait for the weights."""
    ref = open_store(url, tmp_path / "writer-cache").put_dir("a", src)
    store = open_store(url, tmp_path / "cache")
    assert store.cache is not None
    config_dir = store.config_dir(ref)
    assert (config_dir / CONFIG_FILE).read_bytes() == (src / CONFIG_FILE).read_bytes()
    assert not (config_dir / WEIGHTS_FILE).exists()
    assert store.cache.fetches == 0 and store.cache.total_bytes() == 0
    assert store.config_dir(ref) == config_dir  # verified, not fetched again
    full = store.path(ref)
    assert store.config_dir(ref) == full  # once cached whole, the entry serves both


def registered(url: str, src: Path, tmp_path: Path) -> tuple[AdapterStore, AdapterRef]:
    """A store whose node cache checks against a real registry, and `src` uploaded as the ingress does:
    into the store, then its digest into the registry."""
    database = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(database)
    sessions = make_session_factory(make_engine(database))
    store = AdapterStore(url, cache_dir=tmp_path / "cache", digests=RegistryDigests(sessions))
    with sessions() as session, session.begin():
        adapter = adapter_registry.create_adapter(session, name="a", owner="public", base_model="m")
        ref = store.put_dir(adapter.id, src)
        weights = digest_file(src / WEIGHTS_FILE)
        adapter_registry.add_version(
            session, adapter=adapter, version=ref.version, rank=4, target_modules=["q_proj"],
            sha256=weights.sha256, size_bytes=weights.size + (src / CONFIG_FILE).stat().st_size,
        )  # fmt: skip
    return store, ref


def forge(directory: Path, ref: AdapterRef, weights: bytes) -> Path:
    """Other weights with a manifest that matches them, under the name that manifest gives: all a
    manifest-only check looks at agrees."""
    (directory / WEIGHTS_FILE).write_bytes(weights)
    manifest = Manifest.of_dir(ref, directory, [CONFIG_FILE, WEIGHTS_FILE]).to_json()
    (directory / MANIFEST_FILE).write_bytes(manifest)
    return directory.rename(directory.with_name(f"v{ref.version}.{content_key(manifest)}"))


def test_a_cache_entry_that_is_not_the_registered_version_is_fetched_again(
    url: str, src: Path, tmp_path: Path
) -> None:
    store, ref = registered(url, src, tmp_path)
    assert store.cache is not None
    good = (src / WEIGHTS_FILE).read_bytes()
    forged = forge(store.path(ref), ref, os.urandom(len(good)))
    trusting = open_store(url, tmp_path / "cache")  # a cache that checks entries by their manifest alone
    assert (trusting.path(ref) / WEIGHTS_FILE).read_bytes() != good
    path = store.path(ref)
    assert (path / WEIGHTS_FILE).read_bytes() == good and store.cache.fetches == 2
    assert not forged.exists()
    assert store.path(ref) == path and store.cache.fetches == 2  # the good copy is a hit


def test_a_stored_version_that_is_not_the_registered_one_is_refused(
    url: str, src: Path, tmp_path: Path
) -> None:
    """Whoever can write to the store can rewrite a version's manifest to match other files."""
    store, ref = registered(url, src, tmp_path)
    assert store.cache is not None
    forged = forge(Path(shutil.copytree(src, tmp_path / "forged")), ref, os.urandom(64 * 1024))
    fs, root = raw(url)
    for name in (WEIGHTS_FILE, MANIFEST_FILE):
        fs.put_file(str(forged / name), f"{root}/{ref.adapter_id}/v{ref.version}/{name}")
    assert open_store(url, tmp_path / "trusting").path(ref).is_dir()  # it passes its own manifest
    with pytest.raises(AdapterLoadFailed, match="not the registered one"):
        store.path(ref)
    with pytest.raises(AdapterLoadFailed, match="not the registered one"):
        store.config_dir(ref)
    assert store.cache.total_bytes() == 0 and store.cache.fetches == 0
    stray = open_store(url, tmp_path / "writer").put_dir("stray", src)
    with pytest.raises(AdapterNotFound):  # stored, but the registry never recorded it
        store.path(stray)
