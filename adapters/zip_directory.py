"""ZipDirectory: what a zip's end-of-central-directory records declare, read without `zipfile`.

`zipfile.ZipFile` reads the whole central directory into memory and builds a ZipInfo per entry before the
caller sees any of them (50k entries are 27 MB of objects; a 1 GB upload of entries about 10 GB). Its size
and entry count are in the end record (or the zip64 end record), so an archive over the limits is refused
from those few bytes first. `zipfile` reads the directory by its declared size, not its entry count,
hence both are checked.
"""

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_EOCD = struct.Struct("<4s4H2LH")  # signature, disk, cd disk, entries here, entries, cd size, cd offset
_EOCD_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")  # zip64 locator: signature, disk, zip64 record offset, disks
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64 = struct.Struct("<4sQ2H2L4Q")  # signature, size, versions, disks, entries here, entries, size, offset
_ZIP64_SIGNATURE = b"PK\x06\x06"
_MAX_COMMENT = 0xFFFF


@dataclass(frozen=True)
class ZipDirectory:
    entries: int  # the larger of the counts the records declare
    size: int  # bytes of the central directory

    @classmethod
    def read(cls, path: Path) -> "ZipDirectory | None":
        """The declared directory, found the way zipfile finds it; None where zipfile will find none either
        (it then fails with BadZipFile before reading any directory)."""
        with path.open("rb") as f:
            f.seek(0, 2)
            file_size = f.tell()
            tail_start = max(0, file_size - _EOCD.size - _MAX_COMMENT)
            f.seek(tail_start)
            tail = f.read()
            at = _end_record_at(tail)
            if at is None:
                return None
            fields = _EOCD.unpack_from(tail, at)
            directory = cls(entries=max(fields[3], fields[4]), size=fields[5])
            return directory.widened(_zip64(f, tail_start + at))

    def widened(self, other: "ZipDirectory | None") -> "ZipDirectory":
        if other is None:
            return self
        return ZipDirectory(max(self.entries, other.entries), max(self.size, other.size))


def _end_record_at(tail: bytes) -> int | None:
    """zipfile._EndRecData: a comment-less end record at the very end first, else the last signature."""
    last = len(tail) - _EOCD.size
    if last >= 0 and tail[last : last + 4] == _EOCD_SIGNATURE and tail[-2:] == b"\0\0":
        return last
    at = tail.rfind(_EOCD_SIGNATURE)
    return None if at < 0 or len(tail) - at < _EOCD.size else at


def _zip64(f: BinaryIO, eocd_at: int) -> ZipDirectory | None:
    """The zip64 end record zipfile would use: right before its locator, right before the end record."""
    locator_at = eocd_at - _LOCATOR.size
    record_at = locator_at - _ZIP64.size
    if record_at < 0:
        return None
    f.seek(record_at)
    data = f.read(_ZIP64.size + _LOCATOR.size)
    if _LOCATOR.unpack_from(data, _ZIP64.size)[0] != _LOCATOR_SIGNATURE:
        return None
    fields = _ZIP64.unpack_from(data)
    if fields[0] != _ZIP64_SIGNATURE:
        return None
    return ZipDirectory(entries=max(fields[6], fields[7]), size=fields[8])
