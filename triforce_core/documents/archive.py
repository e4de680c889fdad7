"""ZIP-based formats (EPUB, DOCX): capped entry-by-entry reading and safe XML."""

from __future__ import annotations

import io
import zipfile

from ..config import one_line
from .document import DocumentError

MB = 1_000_000
ZIP_MAX_ENTRIES = 5_000
ZIP_MAX_TOTAL = 200 * MB  # total uncompressed bytes read from one archive
ZIP_MAX_ENTRY = 50 * MB  # uncompressed bytes of one entry
ZIP_MAX_RATIO = 100  # uncompressed / compressed, for entries above 1 MB


class Archive:
    """Capped, entry-by-entry access to a ZIP archive held in memory."""

    def __init__(self, data: bytes, kind: str):
        self.kind = kind
        try:
            self.zf = zipfile.ZipFile(io.BytesIO(data))
            infos = self.zf.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as e:
            raise DocumentError(f"malformed {kind} (bad ZIP archive: {one_line(e, 200)})") from None
        if len(infos) > ZIP_MAX_ENTRIES:
            raise DocumentError(f"the {kind} has {len(infos)} entries, over the limit of {ZIP_MAX_ENTRIES}")
        declared = sum(i.file_size for i in infos)
        if declared > ZIP_MAX_TOTAL:
            raise DocumentError(f"the {kind} would unpack to {declared / MB:.0f} MB, over the {ZIP_MAX_TOTAL / MB:.0f} MB limit")
        for i in infos:
            self._check(i)
        self.infos = {i.filename: i for i in infos}
        self.read_total = 0

    def _check(self, info: zipfile.ZipInfo) -> None:
        if info.file_size > ZIP_MAX_ENTRY:
            raise DocumentError(f"{self.kind} entry {info.filename!r} unpacks to {info.file_size / MB:.0f} MB, over the {ZIP_MAX_ENTRY / MB:.0f} MB limit")
        if info.file_size > MB and info.file_size > ZIP_MAX_RATIO * max(1, info.compress_size):
            raise DocumentError(f"{self.kind} entry {info.filename!r} is compressed {info.file_size // max(1, info.compress_size)}:1 (a zip bomb?)")

    def has(self, name: str) -> bool:
        return name in self.infos

    def read(self, name: str) -> bytes:
        info = self.infos.get(name)
        if info is None:
            raise DocumentError(f"malformed {self.kind} (missing entry {name!r})")
        if info.flag_bits & 0x1:
            raise DocumentError(f"the {self.kind} is encrypted")
        limit = min(ZIP_MAX_ENTRY, ZIP_MAX_TOTAL - self.read_total)
        try:
            with self.zf.open(info) as f:
                data = f.read(limit + 1)  # never trust the declared size
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
            raise DocumentError(f"malformed {self.kind} (entry {name!r}: {one_line(e, 200)})") from None
        if len(data) > limit:
            raise DocumentError(f"the {self.kind} unpacks to more than its declared size (a zip bomb?)")
        self.read_total += len(data)
        return data


def parse_xml(data: bytes, what: str):
    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import fromstring
    from xml.etree.ElementTree import ParseError

    try:
        return fromstring(data, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except DefusedXmlException:
        raise DocumentError(f"unsafe XML in {what} (entity declarations are not allowed)") from None
    except ParseError as e:
        raise DocumentError(f"malformed XML in {what} ({one_line(e, 200)})") from None


def local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]
