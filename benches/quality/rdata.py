"""Pure-Python reader for R's lazy-load databases (``*.rdb`` + ``*.rdx``).

An R package's ``data/Rdata.rdx`` is a gzip/zlib-compressed serialization of an R list
``list(variables=, references=, compressed=)``; ``variables`` maps each object name to an
integer pair ``(offset, length)`` into ``data/Rdata.rdb``.  Each record there is a 4-byte
big-endian uncompressed length followed by a compressed stream (zlib when ``compressed`` is
TRUE/1; a type byte ``'Z'``, ``'2'`` (bzip2), ``'X'`` (xz) or ``'0'`` (none) then the stream
when it is 2 or 3), whose content is one object in R's XDR serialization format.

Only what character vectors need is implemented fully (STRSXP/CHARSXP, pairlists for
attributes, atomic vectors, lists, symbols and references); environments, closures and
bytecode raise :class:`RDecodeError`.  No R is required.

Format reference: R Internals, "Serialization Formats"; src/main/serialize.c.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib

# SEXP type codes (Rinternals.h) and the pseudo-types used only in serialized streams.
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP = 9, 10, 13, 14, 15, 16
DOTSXP, VECSXP, EXPRSXP, RAWSXP = 17, 19, 20, 24
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241
MISSINGARG_SXP, UNBOUNDVALUE_SXP, BASENAMESPACE_SXP = 251, 252, 250
ATTRLISTSXP, ATTRLANGSXP = 239, 240

NA_INTEGER = -(2**31)


class RDecodeError(ValueError):
    """The stream is not something this reader understands."""


class RSymbol(str):
    """An R symbol (its print name)."""


class RObject:
    """A decoded R value with attributes: ``value`` (list / str / None ...) and ``attrs`` dict."""

    def __init__(self, value, attrs=None):
        self.value = value
        self.attrs = attrs or {}

    def __repr__(self):  # pragma: no cover - debugging aid
        return f"RObject({self.value!r:.60}, attrs={list(self.attrs)})"


def decompress_any(data: bytes) -> bytes:
    """Decompress a gzip, zlib, bzip2 or xz blob (sniffed from its magic bytes)."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return zlib.decompress(data)


class XdrReader:
    """Reads one R object from an XDR ("X\\n") serialization stream."""

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0
        self.refs: list = []

    # -- primitives ---------------------------------------------------------------------
    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise RDecodeError(f"truncated stream: need {n} bytes at offset {self.pos}")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    # -- header -------------------------------------------------------------------------
    def header(self) -> int:
        """Checks the 'X\\n' magic and version; returns the format version (2 or 3)."""
        magic = self._take(2)
        if magic != b"X\n":
            raise RDecodeError(f"not an XDR serialization (magic {magic!r}); only 'X\\n' is supported")
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            nelen = self.int()
            self._take(nelen)  # native encoding name, e.g. b"UTF-8"
        elif version != 2:
            raise RDecodeError(f"serialization version {version} not supported")
        return version

    # -- items --------------------------------------------------------------------------
    def charsxp(self, flags: int):
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self._take(n)
        levels = flags >> 12
        # LATIN1_MASK (1<<2), UTF8 (1<<3), ASCII (1<<6); bytes (1<<1) are left as latin-1
        if levels & (1 << 2):
            return raw.decode("latin-1")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")

    def attributes(self, has_attr: bool) -> dict:
        if not has_attr:
            return {}
        pl = self.item()
        return dict(pl) if isinstance(pl, list) else {}

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if t == NILVALUE_SXP:
            return None
        if t in (GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP, BASENAMESPACE_SXP, MISSINGARG_SXP, UNBOUNDVALUE_SXP):
            return RObject(None, {"special": t})
        if t == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == SYMSXP:
            name = self.item()  # a CHARSXP
            sym = RSymbol(name if name is not None else "NA")
            self.refs.append(sym)
            return sym
        if t in (LISTSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
            # Pairlist node: [attr] [tag] car cdr; returned as a list of (tag, value).
            out = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                car = self.item()
                out.append((str(tag) if tag is not None else None, car))
                flags = self.int()
                t = flags & 0xFF
                has_attr = bool(flags & (1 << 9))
                has_tag = bool(flags & (1 << 10))
                if t == NILVALUE_SXP:
                    return out
                if t not in (LISTSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP):
                    # cdr is not a pairlist node: decode it by rewinding the flags we read
                    self.pos -= 4
                    out.append((None, self.item()))
                    return out
        if t == CHARSXP:
            return self.charsxp(flags)
        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals = list(struct.unpack(f">{n}i", self._take(4 * n)))
            vals = [None if v == NA_INTEGER else v for v in vals]
            if t == LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
            return self._with_attrs(vals, has_attr)
        if t == REALSXP:
            n = self.length()
            return self._with_attrs(list(struct.unpack(f">{n}d", self._take(8 * n))), has_attr)
        if t == CPLXSXP:
            n = self.length()
            d = struct.unpack(f">{2 * n}d", self._take(16 * n))
            return self._with_attrs([complex(d[2 * i], d[2 * i + 1]) for i in range(n)], has_attr)
        if t == RAWSXP:
            n = self.length()
            return self._with_attrs(self._take(n), has_attr)
        if t == STRSXP:
            n = self.length()
            vals = []
            for _ in range(n):
                f = self.int()
                if f & 0xFF != CHARSXP:
                    raise RDecodeError(f"STRSXP element has type {f & 0xFF}, expected CHARSXP")
                vals.append(self.charsxp(f))
            return self._with_attrs(vals, has_attr)
        if t in (VECSXP, EXPRSXP):
            n = self.length()
            vals = [self.item() for _ in range(n)]
            return self._with_attrs(vals, has_attr)
        raise RDecodeError(f"SEXP type {t} (flags {flags:#x}) at offset {self.pos - 4} not supported")

    def _with_attrs(self, value, has_attr: bool):
        attrs = self.attributes(has_attr)
        return RObject(value, attrs) if attrs else value


def unserialize(buf: bytes):
    """Decodes one XDR-serialized R object (already decompressed)."""
    r = XdrReader(buf)
    r.header()
    return r.item()


def plain(obj):
    """Strips an :class:`RObject` wrapper, returning its value."""
    return obj.value if isinstance(obj, RObject) else obj


def read_rdx(rdx_bytes: bytes) -> dict:
    """Parses an ``.rdx`` index: returns ``{"variables": {name: (offset, length)}, "compressed": c}``."""
    obj = unserialize(decompress_any(rdx_bytes))
    names = obj.attrs.get("names") if isinstance(obj, RObject) else None
    if names is None:
        raise RDecodeError("rdx index is not a named list")
    fields = dict(zip(plain(names), obj.value))
    var = fields["variables"]
    var_names = plain(var.attrs["names"])
    variables = {n: tuple(plain(v)) for n, v in zip(var_names, var.value)}
    comp = plain(fields.get("compressed", [True]))
    comp = comp[0] if isinstance(comp, list) else comp
    return {"variables": variables, "compressed": comp}


def read_rdb_record(rdb: bytes, offset: int, length: int, compressed=True):
    """Decodes the object stored at ``rdb[offset:offset+length]``."""
    rec = rdb[offset:offset + length]
    if len(rec) != length:
        raise RDecodeError(f"record ({offset}, {length}) past the end of the rdb ({len(rdb)} bytes)")
    (n,) = struct.unpack(">I", rec[:4])
    body = rec[4:]
    if compressed in (2, 3) and not isinstance(compressed, bool):
        kind, body = body[:1], body[1:]
        data = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}[kind](body)
    elif compressed:
        data = zlib.decompress(body)
    else:
        data = body
    if len(data) != n:
        raise RDecodeError(f"record decompressed to {len(data)} bytes, header says {n}")
    return unserialize(data)


def read_lazyload_db(rdb_path, rdx_path) -> dict:
    """Returns ``{name: decoded object}`` for every variable of an R lazy-load database."""
    with open(rdx_path, "rb") as f:
        index = read_rdx(f.read())
    with open(rdb_path, "rb") as f:
        rdb = f.read()
    return {name: read_rdb_record(rdb, off, ln, index["compressed"]) for name, (off, ln) in index["variables"].items()}


# -- tiny hand-made stream, used by the self-test ---------------------------------------
def _xdr_int(v: int) -> bytes:
    return struct.pack(">i", v)


def make_xdr_strvec(strings) -> bytes:
    """Hand-builds an XDR serialization (version 3) of a character vector (None = NA)."""
    out = b"X\n" + _xdr_int(3) + _xdr_int(0x040300) + _xdr_int(0x030500) + _xdr_int(5) + b"UTF-8"
    out += _xdr_int(STRSXP) + _xdr_int(len(strings))
    for s in strings:
        if s is None:
            out += _xdr_int(CHARSXP) + _xdr_int(-1)
        else:
            b = s.encode("utf-8")
            levels = (1 << 6) if s.isascii() else (1 << 3)  # ASCII or UTF8 mask
            out += _xdr_int(CHARSXP | (levels << 12)) + _xdr_int(len(b)) + b
    return out


def selftest() -> None:
    """Decodes a hand-made vector, a record wrapped as in an .rdb, and a named-list index."""
    strings = ["PRIDE AND PREJUDICE", "", None, "Élisabeth — “quoted”"]
    buf = make_xdr_strvec(strings)
    assert unserialize(buf) == strings, unserialize(buf)
    rec = struct.pack(">I", len(buf)) + zlib.compress(buf)
    assert read_rdb_record(rec, 0, len(rec), True) == strings
    # version-2 header, integer vector with a names attribute (a pairlist with a tag)
    v2 = b"X\n" + _xdr_int(2) + _xdr_int(0x030500) + _xdr_int(0x020300)
    v2 += _xdr_int(INTSXP | (1 << 9)) + _xdr_int(2) + _xdr_int(7) + _xdr_int(NA_INTEGER)
    v2 += _xdr_int(LISTSXP | (1 << 10)) + _xdr_int(SYMSXP) + _xdr_int(CHARSXP) + _xdr_int(5) + b"names"
    v2 += _xdr_int(STRSXP) + _xdr_int(2) + _xdr_int(CHARSXP) + _xdr_int(1) + b"a" + _xdr_int(CHARSXP) + _xdr_int(1) + b"b"
    v2 += _xdr_int(NILVALUE_SXP)
    obj = unserialize(v2)
    assert isinstance(obj, RObject) and obj.value == [7, None] and obj.attrs == {"names": ["a", "b"]}, obj
    try:
        unserialize(b"A\n" + buf[2:])
    except RDecodeError:
        pass
    else:
        raise AssertionError("ASCII format must be rejected")


if __name__ == "__main__":
    selftest()
    print("rdata selftest ok")
