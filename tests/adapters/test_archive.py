"""extract_adapter_archive against hostile uploads. Every archive is built here, with the tarfile/zipfile APIs
or byte by byte where those refuse to write the lie; every refusal must leave `dest` empty and touch nothing
outside it."""

import gzip
import io
import os
import stat
import struct
import tarfile
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from adapters import archive as archive_module
from adapters.archive import ArchiveLimits, extract_adapter_archive
from adapters.errors import AdapterInvalid
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

CONFIG = b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}'
WEIGHTS = bytes(range(256)) * 8  # a stand-in: the archive layer never parses the weights
ADAPTER = {CONFIG_FILE: CONFIG, WEIGHTS_FILE: WEIGHTS}
RAW_ADAPTER = [(name.encode(), data) for name, data in ADAPTER.items()]
BOMB_BYTES = 50 * 1024 * 1024
TarMember = tuple[tarfile.TarInfo, bytes]
Refuse = Callable[..., AdapterInvalid]


# Builders ---------------------------------------------------------------------------------------------------


def tar_file(name: str, data: bytes = b"", *, mode: int = 0o644) -> TarMember:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    return info, data


def tar_special(name: str, kind: bytes, linkname: str = "") -> TarMember:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, b""


def adapter_members(prefix: str = "", extra: dict[str, bytes] | None = None) -> list[TarMember]:
    return [tar_file(prefix + name, data) for name, data in {**ADAPTER, **(extra or {})}.items()]


def tar_bytes(members: list[TarMember], *, fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """An uncompressed tar; tarfile writes the names as given (it only sanitises on extraction)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def write_tgz(path: Path, members: list[TarMember], *, fmt: int = tarfile.GNU_FORMAT) -> Path:
    path.write_bytes(gzip.compress(tar_bytes(members, fmt=fmt)))
    return path


def zip_entry(name: str, *, file_type: int = 0, mode: int = 0o644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # Unix: the high 16 bits of external_attr are st_mode
    info.external_attr = (file_type | mode) << 16
    return info


def write_zip(path: Path, entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    # Stored, so that tests can patch header bytes without meeting them again inside compressed data.
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for entry, data in entries:
            zf.writestr(entry, data)
    return path


def raw_zip(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A stored zip written by hand, for names zipfile will not write (empty, or holding a NUL)."""
    body, central = b"", b""
    for name, data in entries:
        crc, size, offset = zlib.crc32(data), len(data), len(body)
        fields = (20, 20, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", *fields) + name
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, size, size, len(name), 0)
        body += name + data
    n = len(entries)
    return body + central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(central), len(body), 0)


def adapter_zip_entries(prefix: str = "") -> list[tuple[zipfile.ZipInfo | str, bytes]]:
    return [(prefix + name, data) for name, data in ADAPTER.items()]


class Zeros(io.RawIOBase):
    """`size` zero bytes, produced on demand so that building a bomb never holds it in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: "WriteableBuffer", /) -> int:
        with memoryview(buffer) as view:
            n = min(len(view), self.left)
            view[:n] = bytes(n)
        self.left -= n
        return n


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# Harness ----------------------------------------------------------------------------------------------------


@pytest.fixture
def upload(tmp_path: Path) -> Path:
    path = tmp_path / "upload"
    path.mkdir()
    return path


@pytest.fixture
def refuse(tmp_path: Path) -> Refuse:
    """refuse(archive, filename=None, limits=None) -> the AdapterInvalid raised, after checking that `dest`
    is empty and that nothing appeared anywhere else under tmp_path (traversal targets land there)."""
    dest = tmp_path / "jail" / "cell" / "dest"

    def run(
        archive: Path, filename: str | None = None, limits: ArchiveLimits | None = None
    ) -> AdapterInvalid:
        before = _tree(tmp_path)
        with pytest.raises(AdapterInvalid) as caught:
            extract_adapter_archive(
                archive, dest, filename=filename or archive.name, limits=limits or ArchiveLimits()
            )
        assert dest.is_dir() and list(dest.iterdir()) == []
        assert _tree(tmp_path) == before | {"jail", "jail/cell", "jail/cell/dest"}
        return caught.value

    return run


def extract(archive: Path, tmp_path: Path) -> Path:
    return extract_adapter_archive(archive, tmp_path / "dest", filename=archive.name)


def assert_named(error: AdapterInvalid, reason: str, name: str) -> None:
    """One problem gives the reason and ends with the member's name (repr'd when not printable)."""
    shown = name if name.isprintable() else repr(name)
    assert any(p.startswith(reason) and p.endswith(f": {shown}") for p in error.problems), error.problems


def assert_adapter(root: Path) -> None:
    assert (root / CONFIG_FILE).read_bytes() == CONFIG
    assert (root / WEIGHTS_FILE).read_bytes() == WEIGHTS


# Happy paths ------------------------------------------------------------------------------------------------


def test_files_at_the_root(upload: Path, tmp_path: Path) -> None:
    root = extract(write_tgz(upload / "a.tar.gz", adapter_members()), tmp_path)
    assert root == tmp_path / "dest"
    assert_adapter(root)


def test_files_in_one_folder_with_extras_tgz(upload: Path, tmp_path: Path) -> None:
    extras = {"README.md": b"# my adapter\n", ".gitattributes": b"*.safetensors filter=lfs\n"}
    members = [tar_special("my-adapter", tarfile.DIRTYPE)]
    members += adapter_members("my-adapter/", {**extras, "training_args.json": b'{"lr": 1e-4}'})
    root = extract(write_tgz(upload / "a.tgz", members), tmp_path)
    assert root == tmp_path / "dest" / "my-adapter"
    assert_adapter(root)
    assert (root / "README.md").read_bytes() == extras["README.md"]
    assert sorted(p.name for p in root.iterdir()) == sorted([*ADAPTER, *extras, "training_args.json"])


def test_tar_made_with_dot_prefix_and_no_exec_bits(upload: Path, tmp_path: Path) -> None:
    # `tar -C dir -czf a.tgz .` writes a "./" member and "./name" paths.
    members = [tar_special(".", tarfile.DIRTYPE)]
    members += [tar_file(f"./{name}", data, mode=0o4777) for name, data in ADAPTER.items()]
    root = extract(write_tgz(upload / "a.tgz", members), tmp_path)
    assert_adapter(root)
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o7111 == 0 for p in root.iterdir())


def test_zip_at_the_root_and_in_a_folder(upload: Path, tmp_path: Path) -> None:
    root = extract(write_zip(upload / "a.zip", adapter_zip_entries()), tmp_path)
    assert_adapter(root)
    archive = upload / "b.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.mkdir("adapter")
        for name, data in ADAPTER.items():
            zf.writestr(f"adapter/{name}", data)
        zf.writestr("adapter/README.md", b"hello")
    root = extract_adapter_archive(archive, tmp_path / "dest2", filename="Adapter.ZIP")
    assert root == tmp_path / "dest2" / "adapter"
    assert_adapter(root)


def test_dest_must_be_empty(upload: Path, tmp_path: Path) -> None:
    archive = write_tgz(upload / "a.tgz", adapter_members())
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        extract_adapter_archive(archive, dest, filename="a.tgz")
    assert [p.name for p in dest.iterdir()] == ["keep"]


# Paths ------------------------------------------------------------------------------------------------------

TRAVERSALS = [
    ("../x", "'..' path components are refused"),
    ("a/../../x", "'..' path components are refused"),
    ("/etc/x", "absolute paths are refused"),
    ("C:/x", "Windows drive letters are refused"),
    ("..\\..\\x", "backslashes in member names are refused"),
    ("a/\x1b[2Jx", "control or non-printable characters in member names are refused"),
]


@pytest.mark.parametrize(("name", "reason"), TRAVERSALS)
def test_tar_path_tricks(name: str, reason: str, upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), tar_file(name, b"pwned")]))
    assert_named(error, reason, name)


@pytest.mark.parametrize(("name", "reason"), TRAVERSALS)
def test_zip_path_tricks(name: str, reason: str, upload: Path, refuse: Refuse) -> None:
    error = refuse(write_zip(upload / "a.zip", [*adapter_zip_entries(), (name, b"pwned")]))
    assert_named(error, reason, name)


def test_absolute_path_into_a_watched_directory(upload: Path, tmp_path: Path, refuse: Refuse) -> None:
    target = f"{tmp_path}/escaped"  # `refuse` would see it appear
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), tar_file(target, b"pwned")]))
    assert f"absolute paths are refused: {target}" in error.problems
    error = refuse(write_zip(upload / "a.zip", [*adapter_zip_entries(), (target, b"pwned")]))
    assert f"absolute paths are refused: {target}" in error.problems


@pytest.mark.parametrize("name", ["../x", "a/../../x", "../../escape/x", "../../escape/"])
def test_second_line_of_defence_holds_without_the_name_checks(
    name: str, upload: Path, refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the name checks switched off, tarfile's data filter and the realpath check still refuse the
    # member before any directory is made for it.
    real_split = archive_module._split_name
    monkeypatch.setattr(
        archive_module, "_split_name", lambda n, is_dir: (real_split(n, is_dir=is_dir)[0], [])
    )
    tar_member = tar_special(name, tarfile.DIRTYPE) if name.endswith("/") else tar_file(name, b"pwned")
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), tar_member]))
    assert any(p.startswith("refused by tarfile's data filter") for p in error.problems), error.problems
    error = refuse(
        write_zip(upload / "a.zip", [*adapter_zip_entries(), (name, b"" if name.endswith("/") else b"x")])
    )
    assert error.problems == [f"member would be written outside the destination: {name}"]


def test_empty_and_nul_names(upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), tar_file("", b"x")]))
    assert any(p.startswith("empty member names are refused") for p in error.problems), error.problems
    (upload / "a.zip").write_bytes(raw_zip([*RAW_ADAPTER, (b"", b"x")]))
    error = refuse(upload / "a.zip")
    assert any(p.startswith("empty member names are refused") for p in error.problems), error.problems
    # ustar names stop at the first NUL; a pax path record and a patched zip name can carry one.
    nul_member = tar_file("placeholder", b"x")
    nul_member[0].pax_headers = {"path": "notes\x00.py"}
    error = refuse(write_tgz(upload / "b.tgz", [*adapter_members(), nul_member], fmt=tarfile.PAX_FORMAT))
    assert "NUL bytes in member names are refused: 'notes\\x00.py'" in error.problems
    (upload / "b.zip").write_bytes(raw_zip([*RAW_ADAPTER, (b"notes\0.py", b"x")]))
    error = refuse(upload / "b.zip")
    assert "NUL bytes in member names are refused: 'notes\\x00.py'" in error.problems


# Member types -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (tar_special("adapter/link", tarfile.SYMTYPE, "/etc/passwd"), "symlinks are refused: adapter/link"),
        (tar_special("adapter/hard", tarfile.LNKTYPE, "adapter/x"), "hardlinks are refused: adapter/hard"),
        (tar_special("adapter/tty", tarfile.CHRTYPE), "device files are refused: adapter/tty"),
        (tar_special("adapter/sda", tarfile.BLKTYPE), "device files are refused: adapter/sda"),
        (tar_special("adapter/pipe", tarfile.FIFOTYPE), "FIFOs are refused: adapter/pipe"),
        (tar_special("adapter/vol", b"V"), "only regular files and directories are allowed: adapter/vol"),
    ],
)
def test_tar_special_members(member: TarMember, reason: str, upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members("adapter/"), member]))
    assert any(p.startswith(reason) for p in error.problems), error.problems


def test_tar_symlink_then_a_file_through_it(upload: Path, tmp_path: Path, refuse: Refuse) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    members = [tar_special("adapter", tarfile.SYMTYPE, str(outside)), *adapter_members("adapter/")]
    error = refuse(write_tgz(upload / "a.tgz", members))
    assert f"symlinks are refused: adapter -> {outside}" in error.problems
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    ("file_type", "reason"),
    [
        (stat.S_IFLNK, "symlinks are refused: adapter/link"),
        (stat.S_IFCHR, "device files are refused: adapter/link"),
        (stat.S_IFIFO, "FIFOs are refused: adapter/link"),
        (stat.S_IFSOCK, "only regular files and directories are allowed: adapter/link"),
    ],
)
def test_zip_special_members(file_type: int, reason: str, upload: Path, refuse: Refuse) -> None:
    entries = [
        *adapter_zip_entries("adapter/"),
        (zip_entry("adapter/link", file_type=file_type), b"/etc/passwd"),
    ]
    error = refuse(write_zip(upload / "a.zip", entries))
    assert any(p.startswith(reason) for p in error.problems), error.problems


def test_pickle_and_code_files_are_named(upload: Path, refuse: Refuse) -> None:
    refused = ["pytorch_model.bin", "a.pt", "b.PTH", "c.pkl", "d.pickle", "e.ckpt", "handler.py", "ext.so"]
    members = adapter_members("adapter/", {name: b"\x80\x04K\x01." for name in refused})
    error = refuse(write_tgz(upload / "a.tgz", members))
    assert "pickle files are refused, never unpickled: adapter/pytorch_model.bin" in error.problems
    assert "code files are refused: adapter/handler.py" in error.problems
    assert len([p for p in error.problems if "files are refused" in p]) == len(refused)
    error = refuse(write_zip(upload / "a.zip", [*adapter_zip_entries(), ("pytorch_model.bin", b"x")]))
    assert error.problems == ["pickle files are refused, never unpickled: pytorch_model.bin"]


def test_every_problem_is_listed(upload: Path, refuse: Refuse) -> None:
    members = [
        *adapter_members(),
        tar_file("../x", b"x"),
        tar_special("link", tarfile.SYMTYPE, "/etc/passwd"),
        tar_file("model.pt", b"x"),
    ]
    error = refuse(write_tgz(upload / "a.tgz", members))
    assert error.problems == [
        "'..' path components are refused (path traversal): ../x",
        "symlinks are refused: link -> /etc/passwd",
        "pickle files are refused, never unpickled: model.pt",
    ]


# Layout -----------------------------------------------------------------------------------------------------


def test_duplicate_names(upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), tar_file("./" + CONFIG_FILE, b"{}")]))
    assert error.problems == [
        f"duplicate member name: ./{CONFIG_FILE} (same as {CONFIG_FILE} after normalisation)"
    ]
    error = refuse(
        write_tgz(upload / "b.tgz", [*adapter_members(), tar_file("Readme.md"), tar_file("README.md")])
    )
    assert any(p.startswith("duplicate member name: README.md") for p in error.problems)
    archive = upload / "a.zip"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate it is asked to write
        write_zip(archive, [*adapter_zip_entries(), (WEIGHTS_FILE, b"evil twin")])
    error = refuse(archive)
    assert any(p.startswith(f"duplicate member name: {WEIGHTS_FILE}") for p in error.problems)


def test_file_and_directory_with_one_name(upload: Path, refuse: Refuse) -> None:
    error = refuse(
        write_tgz(upload / "a.tgz", [*adapter_members(), tar_file("x", b"1"), tar_file("x/y", b"2")])
    )
    assert "member inside a path that is a file: x/y" in error.problems


def test_two_top_level_folders(upload: Path, refuse: Refuse) -> None:
    members = [tar_file(f"a/{CONFIG_FILE}", CONFIG), tar_file(f"b/{WEIGHTS_FILE}", WEIGHTS)]
    error = refuse(write_tgz(upload / "a.tgz", members))
    assert error.problems == [
        "several top-level folders (a, b): put the adapter files at the archive root or in a single folder"
    ]


def test_missing_adapter_files(upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", [tar_file(f"adapter/{CONFIG_FILE}", CONFIG)]))
    assert error.problems == [f"missing {WEIGHTS_FILE} in folder adapter/"]
    error = refuse(write_zip(upload / "a.zip", []))
    assert error.problems == ["the archive holds no files"]


# Sizes ------------------------------------------------------------------------------------------------------


def test_too_many_members(upload: Path, refuse: Refuse) -> None:
    members = adapter_members(extra={f"notes/{i}.txt": b"x" for i in range(15)})
    error = refuse(write_tgz(upload / "a.tgz", members))
    assert error.problems == ["too many members: more than 16 (directories included)"]
    entries = [*adapter_zip_entries(), *((f"n{i}.txt", b"x") for i in range(14))]
    assert extract(write_zip(upload / "ok.zip", entries), upload.parent)  # 16 is fine
    error = refuse(write_zip(upload / "a.zip", [*entries, ("one-more/", b"")]))
    assert error.problems == ["too many members: more than 16 (directories included)"]


def test_oversized_member_and_total(upload: Path, refuse: Refuse) -> None:
    limits = ArchiveLimits(max_member_bytes=1000, max_total_bytes=5000, max_ratio=1e6)
    big = bytes(range(256)) * 8  # 2048 bytes
    error = refuse(write_tgz(upload / "a.tgz", adapter_members(extra={"big.txt": big})), limits=limits)
    assert "member too large: big.txt declares 2048 bytes, more than max_member_bytes=1000" in error.problems
    limits = ArchiveLimits(max_total_bytes=3000, max_ratio=1e6)
    error = refuse(write_zip(upload / "a.zip", [*adapter_zip_entries(), ("x.txt", big)]), limits=limits)
    assert error.problems == [
        "total size too large: members declare more than max_total_bytes=3000 bytes uncompressed"
    ]


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """50 MiB of zeros in ~50 KiB, as a tar.gz and as a zip (built once: compressing takes the time)."""
    out = tmp_path_factory.mktemp("bombs")
    tgz = out / "bomb.tar.gz"
    with tarfile.open(tgz, "w:gz", compresslevel=9) as tar:
        for info, data in adapter_members():
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("zeros.txt")
        info.size = BOMB_BYTES
        tar.addfile(info, Zeros(BOMB_BYTES))
    zip_path = out / "bomb.zip"
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, data in ADAPTER.items():
            zf.writestr(name, data)
        with zf.open("zeros.txt", "w") as f:
            for _ in range(BOMB_BYTES // (1024 * 1024)):
                f.write(bytes(1024 * 1024))
    return {"tgz": tgz, "zip": zip_path}


@pytest.mark.parametrize("kind", ["tgz", "zip"])
def test_decompression_bomb(kind: str, bombs: dict[str, Path], refuse: Refuse) -> None:
    archive = bombs[kind]
    assert archive.stat().st_size < BOMB_BYTES / 200
    error = refuse(archive)  # refused from the declared sizes, before a byte of the zeros is written
    assert len(error.problems) == 1 and error.problems[0].startswith(
        f"compression ratio too high: members declare {BOMB_BYTES + len(CONFIG) + len(WEIGHTS)} bytes"
    )
    # Within the ratio but not the total. (The tar stream is also cut off past the limit, not read whole.)
    error = refuse(archive, limits=ArchiveLimits(max_total_bytes=4 * 1024 * 1024, max_ratio=1e9))
    assert error.problems == [
        "total size too large: members declare more than max_total_bytes=4194304 bytes uncompressed"
    ]


def test_tar_bomb_is_not_decompressed_whole(
    bombs: dict[str, Path], refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the headers have condemned the archive, the rest is only scanned for more problems, and that scan
    # stops at the limits (here 200 x 50 KiB) instead of inflating all 50 MiB.
    inflated = 0
    real_read = gzip.GzipFile.read

    def counting_read(self: gzip.GzipFile, size: int = -1) -> bytes:
        nonlocal inflated
        data = real_read(self, size)
        inflated += len(data)
        return data

    monkeypatch.setattr(gzip.GzipFile, "read", counting_read)
    refuse(bombs["tgz"])
    assert 0 < inflated < BOMB_BYTES / 4


def test_oversized_pax_header_is_not_read_into_memory(upload: Path, refuse: Refuse) -> None:
    member = tar_file("README.md", b"hi")
    member[0].pax_headers = {"comment": "x" * (8 * 1024 * 1024)}
    error = refuse(write_tgz(upload / "a.tgz", [*adapter_members(), member], fmt=tarfile.PAX_FORMAT))
    assert error.problems == [
        f"oversized tar metadata after {WEIGHTS_FILE} (a pax/GNU header or padding bomb?)"
    ]


def test_zeros_after_the_end_marker(upload: Path, refuse: Refuse) -> None:
    archive = upload / "a.tgz"
    archive.write_bytes(gzip.compress(tar_bytes(adapter_members()) + bytes(8 * 1024 * 1024)))
    error = refuse(archive)
    assert error.problems == [
        "oversized tar metadata after the end-of-archive marker (a pax/GNU header or padding bomb?)"
    ]


def test_bytes_are_counted_as_written_not_taken_from_headers(
    upload: Path, refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Should tarfile ever hand over more than a header declares, the copy loop still stops.
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, member: io.BytesIO(b"x" * 5000))
    error = refuse(write_tgz(upload / "a.tgz", adapter_members()))
    assert error.problems == [f"{CONFIG_FILE} holds more data than its header declares ({len(CONFIG)} bytes)"]
    limits = ArchiveLimits(max_member_bytes=4000, max_ratio=1e6)
    error = refuse(write_tgz(upload / "b.tgz", adapter_members()), limits=limits)
    assert error.problems == [f"member too large: {CONFIG_FILE} holds more than max_member_bytes=4000"]


# Lying, broken and mislabelled archives ---------------------------------------------------------------------


def _understated_tar() -> bytes:
    """adapter_config.json's header says 10 bytes, but 3000 follow: the rest would be parsed as headers."""
    info = tarfile.TarInfo(CONFIG_FILE)
    info.size = 10
    smuggled = b"A" * 3000
    raw = info.tobuf(tarfile.GNU_FORMAT) + smuggled + bytes(-len(smuggled) % 512)
    return raw + tar_bytes([tar_file(WEIGHTS_FILE, WEIGHTS)])


def _overstated_tar() -> bytes:
    info = tarfile.TarInfo(CONFIG_FILE)
    info.size = 100_000
    return info.tobuf(tarfile.GNU_FORMAT) + CONFIG + bytes(-len(CONFIG) % 512) + bytes(1024)


def _cut_at_member_boundary() -> bytes:
    raw = tar_bytes(adapter_members())
    return raw[: 512 + 512]  # the first member only: no second member, no end marker


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (_understated_tar(), "misstates its size"),
        (_overstated_tar(), "unexpected end of data"),
        (_cut_at_member_boundary(), "truncated"),
        (b"\x00" * 100, "truncated"),
    ],
)
def test_lying_and_truncated_tars(raw: bytes, reason: str, upload: Path, refuse: Refuse) -> None:
    archive = upload / "a.tar.gz"
    archive.write_bytes(gzip.compress(raw))
    error = refuse(archive)
    last = error.problems[-1]  # an overstated size also trips the ratio check first
    assert last.startswith("a.tar.gz: corrupt or truncated archive") and reason in last


def test_data_after_the_end_marker(upload: Path, refuse: Refuse) -> None:
    archive = upload / "a.tgz"
    archive.write_bytes(gzip.compress(tar_bytes(adapter_members()) + b"smuggled member" * 100))
    error = refuse(archive)
    assert error.problems == [
        "data after the tar end-of-archive marker (a member's header may understate its size)"
    ]


def test_truncated_archives(upload: Path, refuse: Refuse) -> None:
    data = gzip.compress(tar_bytes(adapter_members()))
    (upload / "a.tgz").write_bytes(data[: len(data) // 2])
    error = refuse(upload / "a.tgz")
    assert error.problems[-1].startswith("a.tgz: corrupt or truncated archive")
    (upload / "b.tgz").write_bytes(data[:-4])  # gzip's length trailer gone: only reading to the end sees it
    error = refuse(upload / "b.tgz")
    assert error.problems[-1].startswith("b.tgz: corrupt or truncated archive")
    zipped = write_zip(upload / "a.zip", adapter_zip_entries()).read_bytes()
    (upload / "a.zip").write_bytes(zipped[: len(zipped) // 2])
    error = refuse(upload / "a.zip")
    assert error.problems == ["a.zip: corrupt or truncated archive (File is not a zip file)"]


def test_corrupt_zip_member(upload: Path, refuse: Refuse) -> None:
    archive = write_zip(upload / "a.zip", adapter_zip_entries())
    archive.write_bytes(archive.read_bytes().replace(CONFIG[:20], b"X" * 20))
    error = refuse(archive)
    assert error.problems == [f"a.zip: corrupt or truncated archive (Bad CRC-32 for file '{CONFIG_FILE}')"]


@pytest.mark.parametrize(
    ("content", "filename", "reason"),
    [
        (
            b"this is not an archive" * 50,
            "a.tar.gz",
            "is not a gzip stream as its name says: its content is not",
        ),
        ("zip", "a.tar.gz", "is not a gzip stream as its name says: its content is a zip archive"),
        ("tgz", "a.zip", "is not a zip archive as its name says: its content is a gzip stream"),
        ("tar", "a.zip", "is not a zip archive as its name says: its content is an uncompressed tar archive"),
        (b"", "a.zip", "is not a zip archive"),
    ],
)
def test_magic_bytes_must_match_the_name(
    content: bytes | str, filename: str, reason: str, upload: Path, refuse: Refuse
) -> None:
    archive = upload / "upload.bin"
    if content == "zip":
        write_zip(archive, adapter_zip_entries())
    elif content == "tgz":
        write_tgz(archive, adapter_members())
    elif content == "tar":
        archive.write_bytes(tar_bytes(adapter_members()))
    else:
        assert isinstance(content, bytes)
        archive.write_bytes(content)
    error = refuse(archive, filename=filename)
    assert error.problems == [f"{filename} {reason}"] or error.problems[0].startswith(f"{filename} {reason}")


def test_encrypted_zip_member(upload: Path, refuse: Refuse) -> None:
    archive = write_zip(upload / "a.zip", adapter_zip_entries())
    data = bytearray(archive.read_bytes())
    for signature, flag_offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local and central headers
        at = data.find(signature)
        data[at + flag_offset] |= 0x1
    archive.write_bytes(bytes(data))
    error = refuse(archive)
    assert error.problems == [f"encrypted members are refused: {CONFIG_FILE}"]


def test_unsupported_zip_compression(upload: Path, refuse: Refuse) -> None:
    archive = upload / "a.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_LZMA) as zf:
        for name, data in ADAPTER.items():
            zf.writestr(name, data)
    error = refuse(archive)
    assert f"unsupported compression method 14 (use deflate): {CONFIG_FILE}" in error.problems


@pytest.mark.parametrize("filename", ["adapter.rar", "adapter.tar", "adapter.tar.bz2", "adapter", "zip"])
def test_unsupported_suffix(filename: str, upload: Path, refuse: Refuse) -> None:
    error = refuse(write_tgz(upload / "a.tgz", adapter_members()), filename=filename)
    assert error.problems == [f"unsupported archive type: {filename} (upload a .tar.gz, .tgz or .zip)"]


# The central directory, judged before zipfile reads it -----------------------------------------------------


def forbid_zipfile(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records every zipfile.ZipFile built from now on: none may be, for a zip refused by its end record."""
    built: list[object] = []

    class Recording(zipfile.ZipFile):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(zipfile, "ZipFile", Recording)  # the module adapters.archive reads it from
    return built


def end_record_at(data: bytes) -> int:
    return data.rindex(b"PK\x05\x06")


def test_too_many_zip_entries_are_refused_from_the_end_record(
    upload: Path, refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [*adapter_zip_entries(), *((f"n{i}.txt", b"") for i in range(2000))]
    archive = write_zip(upload / "a.zip", entries)
    built = forbid_zipfile(monkeypatch)
    error = refuse(archive)
    assert "too many members: more than 16 (directories included)" in error.problems
    assert built == []


def test_an_end_record_understating_the_entry_count_is_refused_by_directory_size(
    upload: Path, refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile reads the directory by its declared size: 2000 entries behind a count of 2 are all parsed."""
    entries = [*adapter_zip_entries(), *((f"n{i}.txt", b"") for i in range(2000))]
    data = bytearray(write_zip(upload / "a.zip", entries).read_bytes())
    at = end_record_at(bytes(data))
    struct.pack_into("<2H", data, at + 8, 2, 2)  # entries on this disk, entries in all
    (upload / "a.zip").write_bytes(data)
    built = forbid_zipfile(monkeypatch)
    error = refuse(upload / "a.zip")
    assert len(error.problems) == 1 and error.problems[0].startswith("zip central directory too large")
    assert built == []


def test_a_zip64_end_record_is_read_too(
    upload: Path, refuse: Refuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_zip(upload / "a.zip", adapter_zip_entries()).read_bytes()
    at = end_record_at(data)
    _, _, _, _, _, size, offset, _ = struct.unpack_from("<4s4H2LH", data, at)
    zip64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 10**9, 10**9, size, offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, size, offset, 0)
    (upload / "a.zip").write_bytes(data[:at] + zip64 + locator + end)
    built = forbid_zipfile(monkeypatch)
    error = refuse(upload / "a.zip")
    assert error.problems == ["too many members: more than 16 (directories included)"]
    assert built == []


def test_extracted_files_are_owner_only(upload: Path, tmp_path: Path) -> None:
    previous = os.umask(0o022)  # permissive: modes must come from creation, not the umask
    try:
        root = extract(write_zip(upload / "a.zip", adapter_zip_entries("adapter/")), tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()} == {0o600}
