"""Hostile uploads to POST /admin/adapters, against the real app on loopback.

Every hostile upload must be refused with 400 or 413 (never a 5xx, never a 201), in the OpenAI error shape,
with a message that names the problem, and must leave no trace: the adapter store, the registry (API and
database rows) and the upload temp dir are snapshotted before and compared after. The base material is the
demo-sql adapter (a valid PEFT adapter for the served tiny Llama), corrupted one way per test; a positive
control at the end shows that the untouched files are accepted, so the suite does not pass by refusing all.
"""

import gzip
import io
import json
import os
import pickle
import random
import stat
import struct
import tarfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from adapters.weights import parse_lora_key
from billing.models import Adapter, AdapterVersion
from tests.app.conftest import MODEL, Served

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
ANY = object()  # an error field the test does not pin down


def key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{which}.weight"


def module(layer: int, name: str) -> str:
    return f"model.layers.{layer}.self_attn.{name}"


# --- state snapshots -------------------------------------------------------------------------------------


def _store_files(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under the store root but staging and trash: (size, mtime) for files, None for dirs."""
    found: dict[str, tuple[int, int] | None] = {}
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if relative.parts[0] in (".tmp", ".trash"):
            continue
        info = path.lstat()
        found[relative.as_posix()] = (info.st_size, info.st_mtime_ns) if stat.S_ISREG(info.st_mode) else None
    return found


def _rows(served: Served, table: Any) -> list[tuple[Any, ...]]:
    with served.services.session_factory() as session:
        return sorted((tuple(row) for row in session.execute(select(table)).all()), key=repr)


def snapshot(served: Served) -> dict[str, Any]:
    with served.admin() as admin:
        listed = admin.get("/admin/adapters", params={"include_deleted": "true"})
    assert listed.status_code == 200, listed.text
    return {
        "store": _store_files(served.services.store.root),
        "api": listed.json(),
        "adapters": _rows(served, Adapter.__table__),
        "versions": _rows(served, AdapterVersion.__table__),
    }


def assert_no_leftovers(served: Served) -> None:
    root = served.services.store.root
    for scratch in (root / ".tmp", root / ".trash", served.data_dir / "uploads"):
        assert not scratch.exists() or not any(scratch.iterdir()), f"left behind: {list(scratch.iterdir())}"


# --- requests --------------------------------------------------------------------------------------------


def post(served: Served, **request: Any) -> httpx.Response:
    with served.admin() as admin:
        return admin.post("/admin/adapters", **request)


def refuse(
    served: Served,
    *,
    status: int = 400,
    mentions: Iterable[str] = (),
    param: object = ANY,
    code: object = ANY,
    **request: Any,
) -> str:
    """Send the upload, check that it is refused properly and changed nothing; return the error message."""
    before = snapshot(served)
    response = post(served, **request)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    message = error["message"]
    assert isinstance(message, str) and message, error
    for needle in mentions:
        assert needle in message, f"{needle!r} not in {message!r}"
    if param is not ANY:
        assert error["param"] == param, error
    if code is not ANY:
        assert error["code"] == code, error
    assert snapshot(served) == before
    assert_no_leftovers(served)
    return message


def form(owner: str, **extra: str) -> dict[str, str]:
    return {"name": "hostile", "owner": owner, "base_model": MODEL, **extra}


def two_parts(config: bytes, weights: bytes) -> dict[str, tuple[str, bytes, str]]:
    return {
        "adapter_config": (CONFIG, config, "application/json"),
        "adapter_model": (WEIGHTS, weights, "application/octet-stream"),
    }


def one_file(filename: str, data: bytes) -> dict[str, tuple[str, bytes, str]]:
    return {"file": (filename, data, "application/octet-stream")}


def multipart(*parts: tuple[bytes, bytes], closed: bool = True) -> dict[str, Any]:
    body = b"".join(b"--BOUNDARY\r\n" + headers + b"\r\n\r\n" + value + b"\r\n" for headers, value in parts)
    if closed:
        body += b"--BOUNDARY--\r\n"
    return {"content": body, "headers": {"content-type": "multipart/form-data; boundary=BOUNDARY"}}


def text_parts(fields: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(f'Content-Disposition: form-data; name="{k}"'.encode(), v.encode()) for k, v in fields.items()]


# --- building material -----------------------------------------------------------------------------------


def tar_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    return info, data


def tar_special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, linkname, 0
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def tar_gz(members: Iterable[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return gzip.compress(buffer.getvalue(), mtime=0)


def zip_member(name: str, data: bytes, mode: int | None = None) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    if mode is not None:
        info.create_system = 3  # Unix: the high 16 bits of external_attr are st_mode
        info.external_attr = mode << 16
    return info, data


def zip_archive(members: Iterable[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for info, data in members:
            archive.writestr(info, data)
    return buffer.getvalue()


def archive(kind: str, members: Iterable[tuple[str, bytes]]) -> tuple[str, bytes]:
    """(filename, bytes) of a .tar.gz or .zip holding regular files."""
    members = list(members)
    if kind == "zip":
        return "adapter.zip", zip_archive(zip_member(name, data) for name, data in members)
    return "adapter.tar.gz", tar_gz(tar_member(name, data) for name, data in members)


class _Zeros(io.RawIOBase):
    """`size` zero bytes, produced as read: a bomb is built without holding it in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


class _Canary:
    """Pickles to a call of os.mkdir(path): if anything ever unpickles it, the directory appears."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.path),)


@pytest.fixture
def owner(served: Served) -> str:
    tenant_id, _ = served.new_tenant(f"hostile-{uuid.uuid4().hex[:12]}")
    return tenant_id


@pytest.fixture(scope="module")
def demo_dir(served: Served) -> Path:
    return served.setup.adapter_dirs["demo-sql"]


@pytest.fixture
def config_bytes(demo_dir: Path) -> bytes:
    return (demo_dir / CONFIG).read_bytes()


@pytest.fixture
def weights_bytes(demo_dir: Path) -> bytes:
    return (demo_dir / WEIGHTS).read_bytes()


@pytest.fixture
def demo_files(config_bytes: bytes, weights_bytes: bytes) -> list[tuple[str, bytes]]:
    return [(CONFIG, config_bytes), (WEIGHTS, weights_bytes)]


def demo_config(demo_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((demo_dir / CONFIG).read_text())
    return config


def demo_tensors(demo_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(demo_dir / WEIGHTS)


def safetensors_bytes(tensors: dict[str, torch.Tensor], tmp_path: Path) -> bytes:
    path = tmp_path / f"{uuid.uuid4().hex}.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, path)
    return path.read_bytes()


def peft_adapter(model: Any, out: Path, *, r: int) -> Path:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,  # random B: every tensor non-zero, as after training
    )
    get_peft_model(model, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def rank32_dir(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(served.setup.model_dir)
    return peft_adapter(model, tmp_path_factory.mktemp("rank32"), r=32)


@pytest.fixture(scope="module")
def wide_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter like demo-sql (rank 8, attention) but trained on a Llama with hidden_size 96, not 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=2048,
        max_position_embeddings=1024,
    )
    return peft_adapter(LlamaForCausalLM(config), tmp_path_factory.mktemp("wide"), r=8)


# --- archives: where members would land ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "template", "needle"),
    [
        ("tar.gz", "../{evil}", "path traversal"),
        ("tar.gz", "my-adapter/../../{evil}", "path traversal"),
        ("tar.gz", "/tmp/{evil}", "absolute paths are refused"),
        ("zip", "../{evil}", "path traversal"),
        ("zip", "my-adapter/../../{evil}", "path traversal"),
        ("zip", "/tmp/{evil}", "absolute paths are refused"),
        ("zip", "..\\{evil}", "backslashes in member names are refused"),
        ("zip", "C:/{evil}", "Windows drive letters are refused"),
    ],
)
def test_member_paths_outside_the_archive_are_refused(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]], kind: str, template: str, needle: str
) -> None:
    evil = f"evil-{uuid.uuid4().hex}"
    name = template.format(evil=evil)
    filename, data = archive(kind, [*demo_files, (name, b"pwned")])
    refuse(served, mentions=[needle, name], data=form(owner), files=one_file(filename, data))
    for root in (served.data_dir, served.services.store.root, Path("/tmp")):
        assert not list(root.rglob(f"{evil}*")), f"{evil} was written under {root}"


def test_pax_header_path_traversal_is_refused(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]]
) -> None:
    evil = f"evil-{uuid.uuid4().hex}"
    info, data = tar_member("harmless.txt", b"pwned")
    info.pax_headers = {"path": f"../{evil}"}  # overrides the ustar name when read
    members = [tar_member(name, content) for name, content in demo_files] + [(info, data)]
    refuse(
        served,
        mentions=["path traversal", f"../{evil}"],
        data=form(owner),
        files=one_file("adapter.tar.gz", tar_gz(members)),
    )
    assert not list(served.data_dir.rglob(f"{evil}*"))


@pytest.mark.parametrize(
    ("member", "needle"),
    [
        (tar_special("link", tarfile.SYMTYPE, "/etc/passwd"), "symlinks are refused: link -> /etc/passwd"),
        (tar_special("leak", tarfile.LNKTYPE, "/etc/passwd"), "hardlinks are refused: leak -> /etc/passwd"),
        (tar_special("twin", tarfile.LNKTYPE, CONFIG), f"hardlinks are refused: twin -> {CONFIG}"),
        (tar_special("null", tarfile.CHRTYPE), "device files are refused: null"),
        (tar_special("disk", tarfile.BLKTYPE), "device files are refused: disk"),
        (tar_special("pipe", tarfile.FIFOTYPE), "FIFOs are refused: pipe"),
    ],
    ids=["symlink", "hardlink-outside", "hardlink-inside", "char-device", "block-device", "fifo"],
)
def test_tar_members_that_are_not_regular_files_are_refused(
    served: Served,
    owner: str,
    demo_files: list[tuple[str, bytes]],
    member: tuple[tarfile.TarInfo, None],
    needle: str,
) -> None:
    members = [tar_member(name, data) for name, data in demo_files] + [member]
    refuse(served, mentions=[needle], data=form(owner), files=one_file("adapter.tar.gz", tar_gz(members)))


def test_weights_replaced_by_a_symlink_are_refused(served: Served, owner: str, config_bytes: bytes) -> None:
    members = [tar_member(CONFIG, config_bytes), tar_special(WEIGHTS, tarfile.SYMTYPE, "/etc/passwd")]
    refuse(
        served,
        mentions=[f"symlinks are refused: {WEIGHTS} -> /etc/passwd"],
        data=form(owner),
        files=one_file("adapter.tar.gz", tar_gz(members)),
    )


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        (stat.S_IFLNK | 0o777, "symlinks are refused: link"),
        (stat.S_IFCHR | 0o644, "device files are refused: link"),
        (stat.S_IFIFO | 0o644, "FIFOs are refused: link"),
    ],
    ids=["symlink", "device", "fifo"],
)
def test_zip_members_that_are_not_regular_files_are_refused(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]], mode: int, needle: str
) -> None:
    members = [zip_member(name, data) for name, data in demo_files]
    members.append(zip_member("link", b"/etc/passwd", mode=mode))
    refuse(served, mentions=[needle], data=form(owner), files=one_file("adapter.zip", zip_archive(members)))


# --- pickles ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
@pytest.mark.parametrize("with_safetensors", [False, True], ids=["instead", "alongside"])
def test_pickle_weights_in_an_archive_are_refused_unopened(
    served: Served,
    owner: str,
    tmp_path: Path,
    config_bytes: bytes,
    weights_bytes: bytes,
    kind: str,
    with_safetensors: bool,
) -> None:
    canary = tmp_path / "unpickled"
    members = [(CONFIG, config_bytes), ("adapter_model.bin", pickle.dumps(_Canary(canary)))]
    if with_safetensors:
        members.append((WEIGHTS, weights_bytes))
    filename, data = archive(kind, members)
    message = refuse(
        served,
        mentions=["pickle files are refused", "adapter_model.bin"],
        data=form(owner),
        files=one_file(filename, data),
    )
    assert ("missing adapter_model.safetensors" in message) is not with_safetensors
    assert not canary.exists()


def test_pickle_sent_as_adapter_model_is_refused_unopened(
    served: Served, owner: str, tmp_path: Path, config_bytes: bytes
) -> None:
    canary = tmp_path / "unpickled"
    files = two_parts(config_bytes, pickle.dumps(_Canary(canary)))
    files["adapter_model"] = ("adapter_model.bin", files["adapter_model"][1], "application/octet-stream")
    refuse(served, mentions=[f"{WEIGHTS} is not a readable safetensors file"], data=form(owner), files=files)
    assert not canary.exists()


# --- decompression bombs and size limits -----------------------------------------------------------------

BOMB_BYTES = 200 * 2**20


def zip_bomb(config: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(*zip_member(CONFIG, config))
        info, _ = zip_member(WEIGHTS, b"")
        with archive.open(info, "w", force_zip64=True) as out:
            zeros = bytes(2**20)
            for _ in range(BOMB_BYTES // len(zeros)):
                out.write(zeros)
    return buffer.getvalue()


def tar_bomb(config: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info, data = tar_member(CONFIG, config)
        tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(WEIGHTS)
        info.size = BOMB_BYTES
        tar.addfile(info, io.BufferedReader(_Zeros(BOMB_BYTES)))
    return buffer.getvalue()


@contextmanager
def peak_disk_use(directory: Path) -> Iterator[list[int]]:
    """Samples the bytes held under `directory` every few milliseconds; the peak is in the list yielded."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total = 0
            try:
                for path in directory.rglob("*"):
                    try:
                        total += path.lstat().st_size if path.is_file() else 0
                    except FileNotFoundError:  # removed while we looked
                        continue
            except FileNotFoundError:  # a directory went away mid-walk: what was counted still counts
                pass
            peak[0] = max(peak[0], total)
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


@pytest.mark.parametrize(("filename", "build"), [("bomb.zip", zip_bomb), ("bomb.tar.gz", tar_bomb)])
def test_decompression_bomb_is_refused_fast_without_extracting(
    served: Served, owner: str, config_bytes: bytes, filename: str, build: Any
) -> None:
    data = build(config_bytes)
    assert len(data) < 1024 * 1024  # ~200 MB of zeros in a few hundred KB
    started = time.monotonic()
    with peak_disk_use(served.data_dir) as peak:
        refuse(
            served,
            mentions=["compression ratio too high: members declare", "decompression bomb"],
            code="invalid_adapter",
            data=form(owner),
            files=one_file(filename, data),
        )
    assert time.monotonic() - started < 10
    assert peak[0] < 16 * 2**20, f"{peak[0]} bytes on disk while refusing the bomb"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_upload_over_max_upload_mb_is_413(
    served: Served, owner: str, config_bytes: bytes, monkeypatch: pytest.MonkeyPatch, framing: str
) -> None:
    monkeypatch.setattr(served.services.settings, "max_upload_mb", 1)
    weights = random.Random(0).randbytes(2 * 2**20)
    if framing == "content-length":  # refused from the header, before the body is read
        request: dict[str, Any] = {"data": form(owner), "files": two_parts(config_bytes, weights)}
    else:  # no length given: refused once the bytes received pass the limit
        disposition = (
            b'Content-Disposition: form-data; name="adapter_model"; filename="adapter_model.safetensors"'
        )
        request = multipart(*text_parts(form(owner)), (disposition, weights))
        body = request.pop("content")
        request["content"] = (body[i : i + 65536] for i in range(0, len(body), 65536))
    started = time.monotonic()
    refuse(served, status=413, mentions=["exceeds the 1.00 MB limit"], code="upload_too_large", **request)
    assert time.monotonic() - started < 10


# --- tensors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "shape", "needle"),
    [
        (
            key(0, "q_proj", "A"),
            (8, 63),
            f"lora_A of {module(0, 'q_proj')} has shape [8, 63], expected [8, 64]",
        ),
        (
            key(1, "k_proj", "B"),
            (64, 8),
            f"lora_B of {module(1, 'k_proj')} has shape [64, 8], expected [32, 8]",
        ),
        (
            key(0, "v_proj", "A"),
            (512,),
            f"lora_A of {module(0, 'v_proj')} has shape [512], expected a matrix",
        ),
    ],
    ids=["wrong-in", "wrong-out", "not-a-matrix"],
)
def test_wrong_tensor_shape_is_refused(
    served: Served,
    owner: str,
    tmp_path: Path,
    demo_dir: Path,
    config_bytes: bytes,
    target: str,
    shape: tuple[int, ...],
    needle: str,
) -> None:
    tensors = demo_tensors(demo_dir)
    tensors[target] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    weights = safetensors_bytes(tensors, tmp_path)
    refuse(served, mentions=[needle], data=form(owner), files=two_parts(config_bytes, weights))


def test_rank_over_max_lora_rank_is_refused(served: Served, owner: str, rank32_dir: Path) -> None:
    files = two_parts((rank32_dir / CONFIG).read_bytes(), (rank32_dir / WEIGHTS).read_bytes())
    refuse(served, mentions=["adapter rank 32 exceeds max_lora_rank 16"], data=form(owner), files=files)


@pytest.mark.parametrize(
    ("value", "needle"),
    [(float("nan"), "contains NaN"), (float("inf"), "contains Inf"), (float("-inf"), "contains Inf")],
    ids=["nan", "inf", "-inf"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_non_finite_weights_are_refused(
    served: Served,
    owner: str,
    tmp_path: Path,
    demo_dir: Path,
    config_bytes: bytes,
    value: float,
    needle: str,
    dtype: torch.dtype,
) -> None:
    tensors = {name: tensor.to(dtype) for name, tensor in demo_tensors(demo_dir).items()}
    target = key(1, "o_proj", "B")
    tensors[target][17, 3] = value
    weights = safetensors_bytes(tensors, tmp_path)
    refuse(
        served,
        mentions=[f"tensor {target} {needle}"],
        data=form(owner),
        files=two_parts(config_bytes, weights),
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("float64", "has dtype F64; LoRA weights must be F32/F16/BF16"),
        ("int", "has dtype I32; LoRA weights must be F32/F16/BF16"),
        ("drop-B", f"module {module(0, 'q_proj')} has lora_A but no lora_B"),
        ("untargeted", "is not targeted by adapter_config.json"),
        ("foreign", "tensors are not LoRA A/B weights"),
        ("embedding", "adapts the embedding/LM head"),
        ("empty", "holds no LoRA tensors"),
    ],
)
def test_tensor_content_problems_are_refused(
    served: Served, owner: str, tmp_path: Path, demo_dir: Path, config_bytes: bytes, change: str, needle: str
) -> None:
    tensors = demo_tensors(demo_dir)
    q_a = key(0, "q_proj", "A")
    if change == "float64":
        tensors[q_a] = tensors[q_a].double()
    elif change == "int":
        tensors[q_a] = torch.ones(8, 64, dtype=torch.int32)
    elif change == "drop-B":
        del tensors[key(0, "q_proj", "B")]
    elif change == "untargeted":
        tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(8, 64)
        tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.zeros(128, 8)
    elif change == "foreign":
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
    elif change == "embedding":
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(2048, 8)
    elif change == "empty":
        tensors = {"unrelated": torch.zeros(1)}
    weights = safetensors_bytes(tensors, tmp_path)
    refuse(served, mentions=[needle], data=form(owner), files=two_parts(config_bytes, weights))


def test_adapter_for_a_base_of_another_shape_lists_every_shape_problem(
    served: Served, owner: str, demo_dir: Path, wide_base_dir: Path
) -> None:
    ours, theirs = demo_tensors(demo_dir), demo_tensors(wide_base_dir)
    assert ours.keys() == theirs.keys()
    mismatched = {name for name in ours if ours[name].shape != theirs[name].shape}
    assert len(mismatched) >= 8  # every lora_A at least (in_features 96 vs 64)
    files = two_parts((wide_base_dir / CONFIG).read_bytes(), (wide_base_dir / WEIGHTS).read_bytes())
    message = refuse(served, data=form(owner), files=files)
    for name in mismatched:
        path, which = parse_lora_key(name) or ("?", "?")
        assert f"lora_{which} of {path} has shape {list(theirs[name].shape)}" in message, name
    assert message.count("has shape") == len(mismatched)


def test_several_problems_are_all_listed_in_one_refusal(
    served: Served, owner: str, tmp_path: Path, demo_dir: Path
) -> None:
    config = demo_config(demo_dir)
    config["rank_pattern"] = {"layers.1.self_attn.v_proj": 32}  # over max_lora_rank 16
    tensors = demo_tensors(demo_dir)
    generator = torch.Generator().manual_seed(0)
    tensors[key(1, "v_proj", "A")] = torch.randn(32, 64, generator=generator)
    tensors[key(1, "v_proj", "B")] = torch.randn(32, 32, generator=generator)
    tensors[key(0, "q_proj", "A")] = torch.randn(8, 63, generator=generator)  # wrong in_features
    tensors[key(0, "k_proj", "B")][0, 0] = float("nan")
    files = two_parts(json.dumps(config).encode(), safetensors_bytes(tensors, tmp_path))
    refuse(
        served,
        mentions=[
            f"lora_A of {module(0, 'q_proj')} has shape [8, 63], expected [8, 64]",
            f"tensor {key(0, 'k_proj', 'B')} contains NaN",
            "adapter rank 32 exceeds max_lora_rank 16",
        ],
        code="invalid_adapter",
        data=form(owner),
        files=files,
    )


def test_several_archive_problems_are_all_listed_in_one_refusal(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]]
) -> None:
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [
        tar_member(name, data) for name, data in demo_files
    ]
    members += [
        tar_member("../escape", b"x"),
        tar_special("link", tarfile.SYMTYPE, "/etc/passwd"),
        tar_member("weights.pt", b"x"),
        tar_member("hook.py", b"import os"),
        tar_member(CONFIG.upper(), b"{}"),
    ]
    refuse(
        served,
        mentions=[
            "path traversal",
            "symlinks are refused",
            "pickle files are refused",
            "code files are refused",
            "duplicate member name",
        ],
        data=form(owner),
        files=one_file("adapter.tar.gz", tar_gz(members)),
    )


# --- missing or garbage files ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
@pytest.mark.parametrize("missing", [CONFIG, WEIGHTS])
@pytest.mark.parametrize("folder", ["", "my-adapter/"], ids=["root", "folder"])
def test_archive_missing_a_file_is_refused(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]], kind: str, missing: str, folder: str
) -> None:
    filename, data = archive(
        kind, [(folder + name, content) for name, content in demo_files if name != missing]
    )
    refuse(served, mentions=[f"missing {missing}"], data=form(owner), files=one_file(filename, data))


@pytest.mark.parametrize("kept", ["adapter_config", "adapter_model"])
def test_one_of_the_two_parts_alone_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes, kept: str
) -> None:
    files = {kept: two_parts(config_bytes, weights_bytes)[kept]}
    refuse(served, mentions=["send either `file`"], code="missing_files", data=form(owner), files=files)


def test_no_files_at_all_is_refused(served: Served, owner: str) -> None:
    refuse(
        served, mentions=["send either `file`"], code="missing_files", **multipart(*text_parts(form(owner)))
    )


def test_empty_archive_is_refused(served: Served, owner: str) -> None:
    refuse(
        served,
        mentions=["holds no files"],
        data=form(owner),
        files=one_file("adapter.zip", zip_archive([])),
    )


@pytest.mark.parametrize(
    ("which", "content", "needle"),
    [
        ("adapter_model", random.Random(1).randbytes(4096), f"{WEIGHTS} is not a readable safetensors file"),
        ("adapter_model", b"", f"{WEIGHTS} is not a readable safetensors file"),
        ("adapter_model", "truncated", f"{WEIGHTS} is not a readable safetensors file"),
        ("adapter_config", random.Random(2).randbytes(512), f"{CONFIG} is not valid JSON"),
        ("adapter_config", b'{"r": 8,', f"{CONFIG} is not valid JSON"),
        ("adapter_config", b"[1, 2]", f"{CONFIG} must hold a JSON object"),
        ("adapter_config", b"{}", "peft_type is missing"),
    ],
    ids=[
        "random-weights",
        "empty-weights",
        "truncated-weights",
        "random-config",
        "bad-json",
        "list",
        "empty",
    ],
)
def test_garbage_in_a_part_is_refused(
    served: Served,
    owner: str,
    config_bytes: bytes,
    weights_bytes: bytes,
    which: str,
    content: bytes | str,
    needle: str,
) -> None:
    files = two_parts(config_bytes, weights_bytes)
    if content == "truncated":
        content = weights_bytes[: len(weights_bytes) // 2]
    assert isinstance(content, bytes)
    files[which] = (files[which][0], content, files[which][2])
    refuse(served, mentions=[needle], data=form(owner), files=files)


@pytest.mark.parametrize(
    ("filename", "content", "needle"),
    [
        ("adapter.tar.gz", random.Random(3).randbytes(8192), "is not a gzip stream as its name says"),
        ("adapter.zip", random.Random(4).randbytes(8192), "is not a zip archive as its name says"),
        ("adapter.tgz", b"", "not a recognised archive format"),
        ("adapter.tar.gz", "zip", "its content is a zip archive"),
        ("adapter.zip", "tar.gz", "its content is a gzip stream"),
        ("adapter.tar.gz", "truncated", "corrupt or truncated archive"),
        ("adapter.zip", "truncated", "corrupt or truncated archive"),
        ("adapter.tar.gz", "gzip-of-garbage", "corrupt or truncated archive"),
        ("adapter.tar", "tar.gz", "unsupported archive type"),
        ("adapter.rar", "zip", "unsupported archive type"),
    ],
)
def test_garbage_or_mislabelled_archive_is_refused(
    served: Served,
    owner: str,
    demo_files: list[tuple[str, bytes]],
    filename: str,
    content: bytes | str,
    needle: str,
) -> None:
    if content == "truncated":
        full = archive("zip" if filename.endswith(".zip") else "tar.gz", demo_files)[1]
        content = full[: len(full) // 2]
    elif content == "gzip-of-garbage":
        content = gzip.compress(random.Random(5).randbytes(8192), mtime=0)
    elif isinstance(content, str):
        content = archive(content, demo_files)[1]
    refuse(served, mentions=[needle], data=form(owner), files=one_file(filename, content))


def test_too_many_members_is_refused(served: Served, owner: str, demo_files: list[tuple[str, bytes]]) -> None:
    filler = [(f"notes/{i}.txt", b"x") for i in range(20)]
    filename, data = archive("zip", [*demo_files, *filler])
    refuse(served, mentions=["too many members"], data=form(owner), files=one_file(filename, data))


# --- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"use_dora": True}, ["use_dora"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
        ({"lora_bias": True}, ["lora_bias"]),
        ({"peft_type": "LOHA"}, ["peft_type='LOHA'"]),
        ({"bias": "all"}, ["bias='all'"]),
        ({"init_lora_weights": "pissa"}, ["init_lora_weights='pissa'"]),
        ({"brand_new_option": 1}, ["brand_new_option"]),
        ({"use_dora": True, "lora_bias": True}, ["use_dora", "lora_bias"]),
    ],
)
def test_unsupported_config_options_are_refused_by_name(
    served: Served,
    owner: str,
    demo_dir: Path,
    weights_bytes: bytes,
    changes: dict[str, Any],
    needles: list[str],
) -> None:
    config = {**demo_config(demo_dir), **changes}
    files = two_parts(json.dumps(config).encode(), weights_bytes)
    refuse(served, mentions=needles, data=form(owner), files=files)


def test_target_module_the_base_lacks_is_refused(
    served: Served, owner: str, tmp_path: Path, demo_dir: Path
) -> None:
    config = {**demo_config(demo_dir), "target_modules": ["q_proj", "fc_in"]}
    tensors = {name: t for name, t in demo_tensors(demo_dir).items() if ".q_proj." in name}
    for layer in (0, 1):
        tensors[f"base_model.model.model.layers.{layer}.mlp.fc_in.lora_A.weight"] = torch.zeros(8, 64)
        tensors[f"base_model.model.model.layers.{layer}.mlp.fc_in.lora_B.weight"] = torch.zeros(128, 8)
    files = two_parts(json.dumps(config).encode(), safetensors_bytes(tensors, tmp_path))
    refuse(
        served,
        mentions=[
            "target modules not found among the base model's servable linear layers: fc_in",
            "model.layers.0.mlp.fc_in is not a servable linear layer of the base model",
        ],
        data=form(owner),
        files=files,
    )


# --- form fields -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("../x", "name must be 1-64 letters"),
        ("", "name must be 1-64 letters"),
        ("x" * 65, "name must be 1-64 letters"),
        ("a/b", "name must be 1-64 letters"),
        ("-x", "name must be 1-64 letters"),
        ("x y", "name must be 1-64 letters"),
        (MODEL, "is a base model's name"),
    ],
    ids=["traversal", "empty", "65-chars", "slash", "leading-dash", "space", "base-model"],
)
def test_invalid_name_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes, name: str, needle: str
) -> None:
    refuse(
        served,
        mentions=[needle],
        param="name",
        data={**form(owner), "name": name},
        files=two_parts(config_bytes, weights_bytes),
    )


def test_missing_name_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    data = {k: v for k, v in form(owner).items() if k != "name"}
    refuse(served, param="name", data=data, files=two_parts(config_bytes, weights_bytes))


def test_missing_owner_is_refused(served: Served, config_bytes: bytes, weights_bytes: bytes) -> None:
    refuse(
        served,
        mentions=["owner is required"],
        param="owner",
        data={"name": "hostile", "base_model": MODEL},
        files=two_parts(config_bytes, weights_bytes),
    )


def test_unknown_owner_is_404(served: Served, config_bytes: bytes, weights_bytes: bytes) -> None:
    refuse(
        served,
        status=404,
        mentions=["tn_doesnotexist", "not found"],
        data=form("tn_doesnotexist"),
        files=two_parts(config_bytes, weights_bytes),
    )


def test_disabled_owner_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    with served.admin() as admin:
        assert admin.delete(f"/admin/tenants/{owner}").status_code == 200
    refuse(
        served,
        mentions=["disabled"],
        param="owner",
        data=form(owner),
        files=two_parts(config_bytes, weights_bytes),
    )


def test_unknown_base_model_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    refuse(
        served,
        mentions=["'gpt-17'", "is not served here", MODEL],
        param="base_model",
        data=form(owner, base_model="gpt-17"),
        files=two_parts(config_bytes, weights_bytes),
    )


def test_archive_and_parts_at_once_are_refused(
    served: Served, owner: str, demo_files: list[tuple[str, bytes]], config_bytes: bytes, weights_bytes: bytes
) -> None:
    files = {
        **two_parts(config_bytes, weights_bytes),
        "file": (*archive("tar.gz", demo_files), "application/gzip"),
    }
    refuse(
        served,
        mentions=["send either `file`"],
        param="file",
        code="missing_files",
        data=form(owner),
        files=files,
    )


def test_unknown_file_field_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    files = {**two_parts(config_bytes, weights_bytes), "weights": ("w.safetensors", weights_bytes)}
    refuse(
        served,
        mentions=["Unexpected file field 'weights'"],
        param="weights",
        code="unexpected_file",
        data=form(owner),
        files=files,
    )


def test_a_file_field_sent_as_text_is_refused(served: Served, owner: str, config_bytes: bytes) -> None:
    refuse(
        served,
        mentions=["'adapter_model' must be sent as a file"],
        param="adapter_model",
        code="expected_file",
        data={**form(owner), "adapter_model": "not a file"},
        files={"adapter_config": (CONFIG, config_bytes)},
    )


def test_oversized_text_field_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    refuse(
        served,
        mentions=["larger than 4096 bytes"],
        param="name",
        code="field_too_large",
        data={**form(owner), "name": "x" * 5000},
        files=two_parts(config_bytes, weights_bytes),
    )


def test_too_many_fields_are_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes
) -> None:
    extra = {f"extra{i}": "x" for i in range(20)}
    refuse(
        served,
        mentions=["Too many form fields"],
        code="too_many_fields",
        data={**form(owner), **extra},
        files=two_parts(config_bytes, weights_bytes),
    )


# --- the request body itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"json": {"name": "hostile", "owner": "public", "base_model": MODEL}},
        {"data": {"name": "hostile", "owner": "public", "base_model": MODEL}},
        {"content": b"--x\r\n", "headers": {"content-type": "multipart/form-data"}},
        {"content": b"", "headers": {"content-type": "text/plain"}},
    ],
    ids=["json", "urlencoded", "multipart-without-boundary", "text"],
)
def test_a_body_that_is_not_multipart_is_refused(served: Served, request_kwargs: dict[str, Any]) -> None:
    refuse(
        served,
        mentions=["Expected a multipart/form-data body"],
        code="invalid_content_type",
        **request_kwargs,
    )


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("unterminated", "the body ended before the closing boundary"),
        ("not-utf8", "field 'name' is not valid UTF-8"),
        ("no-disposition", "every part needs `Content-Disposition: form-data` with a name"),
        ("duplicate", "Field 'name' appears more than once"),
    ],
)
def test_malformed_multipart_is_refused(
    served: Served, owner: str, config_bytes: bytes, case: str, needle: str
) -> None:
    name = (b'Content-Disposition: form-data; name="name"', b"hostile")
    owner_part = (b'Content-Disposition: form-data; name="owner"', owner.encode())
    config = (
        b'Content-Disposition: form-data; name="adapter_config"; filename="adapter_config.json"',
        config_bytes,
    )
    request = {
        "unterminated": multipart(name, owner_part, config, closed=False),
        "not-utf8": multipart((name[0], b"\xff\xfe"), owner_part, config),
        "no-disposition": multipart(name, (b"Content-Type: text/plain", b"x"), config),
        "duplicate": multipart(name, owner_part, name, config),
    }[case]
    refuse(served, mentions=[needle], **request)


# --- config values that once slipped through (500s, or accepted and broken at load time) ---------------


@pytest.mark.parametrize(
    "config_text",
    [
        pytest.param(
            "[" * 100_000 + "]" * 100_000,
            id="deeply-nested",
        ),
        pytest.param(
            '{"peft_type": "LORA", "r": ' + "9" * 5000 + "}",
            id="huge-integer",
        ),
    ],
)
def test_hostile_json_in_the_config_is_refused(
    served: Served, owner: str, weights_bytes: bytes, config_text: str
) -> None:
    refuse(
        served,
        mentions=[CONFIG],
        data=form(owner),
        files=two_parts(config_text.encode(), weights_bytes),
    )


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        pytest.param(
            {"rank_pattern": {"(": 4}},
            "rank_pattern",
            id="rank_pattern",
        ),
        pytest.param(
            {"exclude_modules": "("},
            "exclude_modules",
            id="exclude_modules",
        ),
        pytest.param(
            {"layers_to_transform": [0], "layers_pattern": "("},
            "layers_pattern",
            id="layers_pattern",
        ),
        pytest.param(
            {"alpha_pattern": {"(": 4.0}},
            "alpha_pattern",
            id="alpha_pattern",
        ),
    ],
)
def test_invalid_regex_in_the_config_is_refused(
    served: Served, owner: str, demo_dir: Path, weights_bytes: bytes, changes: dict[str, Any], needle: str
) -> None:
    config = {**demo_config(demo_dir), **changes}
    refuse(
        served,
        mentions=[needle],
        data=form(owner),
        files=two_parts(json.dumps(config).encode(), weights_bytes),
    )


@pytest.mark.parametrize(
    "alpha_json",
    ['"lora_alpha": NaN', '"lora_alpha": Infinity', '"alpha_pattern": {"q_proj": NaN}'],
    ids=["alpha-nan", "alpha-inf", "alpha-pattern-nan"],
)
def test_non_finite_lora_alpha_is_refused(
    served: Served, owner: str, config_bytes: bytes, weights_bytes: bytes, alpha_json: str
) -> None:
    field = alpha_json.split(":", 1)[0].strip('"')
    config = json.loads(config_bytes)
    config.pop(field)
    text = json.dumps(config)[:-1] + ", " + alpha_json + "}"
    refuse(served, mentions=[field], data=form(owner), files=two_parts(text.encode(), weights_bytes))


CATASTROPHIC = "(.+)+z"  # Python's re backtracks for minutes on a 30-character module path
ALTERNATION = "(.|.)*z"  # the (a|a)*b kind: two ways to match each character, 2^n paths to try


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({"target_modules": CATASTROPHIC}, 400, id="target_modules"),
        pytest.param({"exclude_modules": CATASTROPHIC}, 201, id="exclude_modules"),
        pytest.param({"rank_pattern": {CATASTROPHIC: 4}}, 201, id="rank_pattern"),
        pytest.param({"alpha_pattern": {CATASTROPHIC: 4.0}}, 201, id="alpha_pattern"),
        pytest.param({"target_modules": ALTERNATION}, 400, id="alternation-target_modules"),
        pytest.param({"rank_pattern": {ALTERNATION: 4}}, 201, id="alternation-rank_pattern"),
        pytest.param(
            {"layers_to_transform": [0], "layers_pattern": CATASTROPHIC, "target_modules": ["q_proj"]},
            400,
            id="layers_pattern",
        ),
    ],
)
def test_catastrophic_regex_in_the_config_is_answered_within_a_second(
    served: Served,
    owner: str,
    demo_dir: Path,
    weights_bytes: bytes,
    changes: dict[str, Any],
    expected: int,
) -> None:
    config = {**demo_config(demo_dir), **changes}
    name = f"regex-{uuid.uuid4().hex[:8]}"
    files = two_parts(json.dumps(config).encode(), weights_bytes)
    post(served, data=form(owner, name="warm-up"), files=files)  # first-upload costs are not the regex's
    started = time.monotonic()
    response = post(served, data=form(owner, name=name), files=files)
    elapsed = time.monotonic() - started
    assert response.status_code == expected, response.text
    assert elapsed < 1.0, f"answered in {elapsed:.2f}s"
    if expected == 400:
        assert "error" in response.json()
    assert_no_leftovers(served)


@pytest.mark.parametrize("pattern", [r"(q)\1_proj", r"(?=q)q_proj", "q" * 300])
def test_regex_that_cannot_be_matched_safely_is_refused(
    served: Served, owner: str, demo_dir: Path, weights_bytes: bytes, pattern: str
) -> None:
    config = {**demo_config(demo_dir), "target_modules": pattern}
    refuse(
        served,
        mentions=["target_modules is not a valid regular expression here"],
        code="invalid_adapter",
        data=form(owner),
        files=two_parts(json.dumps(config).encode(), weights_bytes),
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lora_alpha", 1e30),
        ("lora_alpha", 0),
        ("lora_alpha", -16),
        ("lora_alpha", 65537.0),
        ("alpha_pattern", {"q_proj": 1e30}),
        ("alpha_pattern", {"q_proj": -1.0}),
    ],
    ids=["huge", "zero", "negative", "just-over", "pattern-huge", "pattern-negative"],
)
def test_absurd_lora_alpha_is_refused_by_name(
    served: Served, owner: str, demo_dir: Path, weights_bytes: bytes, field: str, value: Any
) -> None:
    config = {**demo_config(demo_dir), field: value}
    refuse(
        served,
        mentions=[field],
        code="invalid_adapter",
        data=form(owner),
        files=two_parts(json.dumps(config).encode(), weights_bytes),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_weights_that_overflow_once_scaled_are_refused(
    served: Served, owner: str, tmp_path: Path, demo_dir: Path, dtype: torch.dtype
) -> None:
    """Finite weights, an alpha within bounds: B times alpha/r is Inf once cast to half precision."""
    config = demo_config(demo_dir)
    config["lora_alpha"] = 60000.0
    tensors = {name: tensor.to(dtype) for name, tensor in demo_tensors(demo_dir).items()}
    target = key(1, "o_proj", "B")
    tensors[target][17, 3] = 10.0  # x 60000/8 = 75000 > 65504, float16's largest
    refuse(
        served,
        mentions=[f"tensor {target} overflows to Inf as served"],
        code="invalid_adapter",
        data=form(owner),
        files=two_parts(json.dumps(config).encode(), safetensors_bytes(tensors, tmp_path)),
    )


def many_entries_zip(count: int) -> bytes:
    """A stored zip of `count` empty members, written straight (zipfile would keep every ZipInfo)."""
    local, central = io.BytesIO(), io.BytesIO()
    for i in range(count):
        name = f"{i:06d}".encode()
        offset = local.tell()
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0) + name)
        central.write(
            struct.pack(
                "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0, 0, 0, 0, 0, offset
            )
            + name
        )
    entries = min(count, 0xFFFF)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, entries, entries, central.tell(), local.tell(), 0)
    return local.getvalue() + central.getvalue() + end


def test_zip_with_too_many_entries_is_refused_before_its_directory_is_read(
    served: Served, owner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50k entries: zipfile would build 50k ZipInfo objects before the member limit ever applied."""
    data = many_entries_zip(50_000)
    opened: list[object] = []

    class NoZipFile(zipfile.ZipFile):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("adapters.archive.zipfile.ZipFile", NoZipFile)
    started = time.monotonic()
    refuse(
        served,
        mentions=["too many members: more than 16"],
        code="invalid_adapter",
        data=form(owner),
        files=one_file("many.zip", data),
    )
    assert time.monotonic() - started < 5
    assert opened == [], "zipfile.ZipFile was built for an archive refused by its end record"


# --- positive control ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["parts", "tar.gz", "zip", "zip-in-folder"])
def test_untouched_demo_files_are_accepted(
    served: Served,
    owner: str,
    demo_files: list[tuple[str, bytes]],
    config_bytes: bytes,
    weights_bytes: bytes,
    how: str,
) -> None:
    if how == "parts":
        files = two_parts(config_bytes, weights_bytes)
    elif how == "zip-in-folder":
        files = one_file(*archive("zip", [(f"my-adapter/{name}", data) for name, data in demo_files]))
    else:
        files = one_file(*archive(how, demo_files))
    before = snapshot(served)
    response = post(served, data=form(owner), files=files)
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["owner"] == owner and created["version"] == 1 and created["rank"] == 8
    after = snapshot(served)
    added = set(after["store"]) - set(before["store"])
    assert added == {
        created["id"],
        f"{created['id']}/v1",
        f"{created['id']}/v1/{CONFIG}",
        f"{created['id']}/v1/{WEIGHTS}",
    }
    assert (served.services.store.root / created["id"] / "v1" / WEIGHTS).read_bytes() == weights_bytes
    assert len(after["adapters"]) == len(before["adapters"]) + 1
    assert len(after["versions"]) == len(before["versions"]) + 1
    assert created["id"] in {a["id"] for a in after["api"]["data"]}
    assert_no_leftovers(served)
