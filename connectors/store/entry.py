"""The entry format: one safetensors blob per encoder output, plus header metadata.

This is the only module that knows the bytes. An entry is a standard safetensors file
holding one tensor named ``ec_cache`` — exactly what vLLM's ``ECExampleConnector``
writes and reads — with encache's bookkeeping in the safetensors ``__metadata__``
(string values only, as the format requires):

    encache_format  "1"
    identifier      the vLLM identifier (``{lora}:{hash}`` with tower LoRA)
    lora            LoRA name or ""
    model           model id string exactly as given to ``--model``
    vllm_version    version of the producing vLLM
    hash_algo       vLLM's mm hasher algorithm (blake3 / sha256 / sha512)
    created         epoch seconds (float, as text)
    checksum        ``xxh3_128x512k:<hex>`` of the tensor bytes (:func:`checksum`;
                    ``xxh3_128:`` and ``blake3:`` of earlier entries also verified)
    encoder_config  digest of the producer's non-default encoder settings
                    (:mod:`encache.connectors.encoder_config`); absent for the default
    lora_digest     digest of the LoRA adapter's files (:mod:`encache.connectors.store.lora_stamp`);
                    absent without a LoRA or for an adapter that is not a local directory
    binding         ``blake3:<hex>`` of the processed inputs the encoder consumed for this
                    item (:mod:`encache.connectors.vllm.binding`): a consumer holding the
                    item's inputs serves the entry only if they digest the same; absent
                    when the producer had no inputs to digest
    keyed_by        ``content`` when the identifier was computed from the item's own
                    bytes (``encache precompute``, ``warm``; a server's vLLM hash where
                    client uuids are namespaced apart, :mod:`encache.connectors.vllm.uuids`):
                    the identifier is then itself a binding of the media; absent for a
                    client uuid's identifier, or where the writer cannot tell

A file without ``encache_format`` is a *legacy* entry (written by ECExampleConnector):
still listable and loadable, but without an integrity check.

A header naming an entry format this build does not read (``encache_format`` not in
:data:`READ_FORMATS`) or a checksum algorithm it does not know (not in
:data:`CHECKSUM_ALGOS`) is an entry written by a newer encache: :class:`NewerFormat`, a
:class:`CorruptEntry` whose ``reason`` is ``newer-format``, raised before anything else of
the header is judged. Every caller that would remove, replace or count a corrupt entry
tells it apart and leaves it alone (``docs/upgrading.md`` has the rules).

The codec imports no tensor library (no torch, no numpy): the CLI reads headers of
100,000 entries without one, and the vLLM adapter turns the returned buffer into a tensor
with ``torch.frombuffer`` (no copy). Headers are decoded by msgspec (a vLLM dependency)
into typed structs, which checks the safetensors types as it parses: a first load of a
0.25 MB entry spends about as long parsing its header as hashing its bytes.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from math import prod

import msgspec
import xxhash
from blake3 import blake3

from .keys import split_lora, validate

FORMAT_VERSION = "1"
#: the entry formats this build reads (every one this repository has written; absent:
#: a legacy entry); any other is a newer encache's (:class:`NewerFormat`)
READ_FORMATS = frozenset({FORMAT_VERSION})
#: the ``reason`` of :class:`NewerFormat` (``EntryInfo.error`` of such an entry in a scan)
NEWER_FORMAT = "newer-format"
TENSOR_KEY = "ec_cache"
MAX_HEADER_BYTES = 1 << 20  # a one-tensor header is a few hundred bytes
_LEN = struct.Struct("<Q")
_KNOWN_METADATA = frozenset({"encache_format", "identifier", "lora", "model", "vllm_version",
                             "hash_algo", "created", "checksum", "encoder_config",
                             "lora_digest", "binding", "keyed_by"})
#: ``keyed_by`` of an entry whose writer computed its identifier from the item's bytes
KEYED_BY_CONTENT = "content"

# safetensors dtype codes -> item size in bytes
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class CorruptEntry(ValueError):
    """Bytes that are not a valid entry; ``reason`` is a short machine-friendly tag."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class NewerFormat(CorruptEntry):
    """An entry written by a newer encache: its format, or its checksum algorithm, is one
    this build does not know. Not corruption: nothing may remove, repair, rewrite or count
    it as corrupt; a consumer misses it (``newer_format``) and ``verify`` reports it apart.
    A :class:`CorruptEntry` still, so any reader that only needs "not usable here" (a load,
    a copy) stays correct without knowing of it."""

    def __init__(self, detail: str):
        super().__init__(NEWER_FORMAT, detail + ": written by a newer encache")


class EntryMeta(msgspec.Struct, frozen=True):
    """What a header says about an entry. ``format_version is None`` means legacy.

    A msgspec struct, not a dataclass: every load parses a header into one, and a
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost more than
    the JSON decode of the header (~5.7 vs ~3 us here); this one is built in C (~0.3
    us), and a store's header index holds it in less memory."""

    identifier: str | None
    dtype: str
    shape: tuple[int, ...]
    data_bytes: int
    lora: str | None = None
    model: str | None = None
    vllm_version: str | None = None
    hash_algo: str | None = None
    created: float | None = None
    checksum: str | None = None
    format_version: str | None = None
    #: digest of the producer's non-default encoder settings; "" = default (or unstamped)
    encoder_config: str = ""
    #: digest of the LoRA adapter's files the entry was produced with; "" = unstamped
    lora_digest: str = ""
    #: digest of the processed inputs the entry was encoded from; "" = unbound
    binding: str = ""
    extra: dict = msgspec.field(default_factory=dict)
    #: ``content``: the writer computed the identifier from the item's bytes; "" = given
    #: (last: pickled header indexes hold fields by position)
    keyed_by: str = ""

    @property
    def legacy(self) -> bool:
        return self.format_version is None

    def to_dict(self) -> dict:
        return {
            "identifier": self.identifier, "lora": self.lora, "model": self.model,
            "dtype": self.dtype, "shape": list(self.shape), "data_bytes": self.data_bytes,
            "vllm_version": self.vllm_version, "hash_algo": self.hash_algo,
            "created": self.created, "checksum": self.checksum,
            "format_version": self.format_version, "legacy": self.legacy,
            "encoder_config": self.encoder_config, "lora_digest": self.lora_digest,
            "binding": self.binding, "keyed_by": self.keyed_by,
        }


#: the checksum new entries record (:func:`checksum`)
CHECKSUM_ALGO = "xxh3_128x512k"
#: every checksum algorithm this build verifies (each one this repository has written)
CHECKSUM_ALGOS = ("xxh3_128x512k", "xxh3_128", "blake3")
_CHECKSUM_PREFIXES = tuple(a + ":" for a in CHECKSUM_ALGOS)
#: the tensor bytes per digest of ``xxh3_128x512k``, a piece (part of the algorithm: fixed)
HASH_PIECE = 512 << 10
_PIECES_PREFIX = CHECKSUM_ALGO + ":"
_PIECES_MARK = b'"checksum":"' + _PIECES_PREFIX.encode()


def checksum(data, algo: str = CHECKSUM_ALGO) -> str:
    """``"<algo>:<hex>"`` of the tensor bytes.

    New entries use ``xxh3_128x512k``: XXH3-128 of each 512 KiB of the tensor bytes (the
    last piece shorter), then XXH3-128 of those digests, concatenated in order. XXH3
    guards against bit rot and torn copies (not against an adversary) at 15-30 GB/s, so
    verifying every load costs a fraction of reading it; hashed in pieces, a load that
    reads an entry on two threads hashes it on both, each thread the pieces it read
    while they are in its CPU's cache (:func:`read_verified`, ``read_ahead``), where one
    XXH3 over the whole tensor is one thread's work. Earlier entries' ``xxh3_128`` (one
    XXH3-128 of the tensor bytes) and ``blake3`` (~3.5 GB/s here) are still verified.
    """
    if algo == "xxh3_128x512k":
        view = memoryview(data).cast("B")
        digests = b"".join([xxhash.xxh3_128_digest(view[i:i + HASH_PIECE])
                            for i in range(0, view.nbytes, HASH_PIECE)])
        return "xxh3_128x512k:" + xxhash.xxh3_128_hexdigest(digests)
    if algo == "xxh3_128":
        return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)
    if algo == "blake3":
        return "blake3:" + blake3(data).hexdigest()
    raise NewerFormat(f"checksum algorithm {algo!r}")


def checksum_matches(data, recorded: str) -> bool:
    algo = recorded.split(":", 1)[0]
    return checksum(data, algo) == recorded


def encode_parts(identifier: str, data, dtype: str, shape, *, model: str | None = None,
                 lora: str | None = None, vllm_version: str | None = None,
                 hash_algo: str | None = None, created: float | None = None,
                 encoder_config: str | None = None,
                 lora_digest: str | None = None,
                 binding: str | None = None,
                 keyed_by: str | None = None) -> tuple[bytes, object]:
    """Return ``(header_bytes, data)``; the entry is their concatenation.

    ``data`` is any buffer (bytes, memoryview, numpy/torch uint8 view) of the tensor in
    little-endian, C order. Kept as two parts so a writer can stream the tensor without
    copying it into one large bytes object.
    """
    validate(identifier)
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    shape = tuple(int(s) for s in shape)
    view = memoryview(data).cast("B")
    nbytes = view.nbytes
    if prod(shape) * DTYPE_SIZES[dtype] != nbytes:
        raise ValueError(f"{nbytes} bytes do not hold a {dtype} tensor of shape {shape}")
    if lora is None:
        lora = split_lora(identifier)[0]
    meta = {
        "encache_format": FORMAT_VERSION,
        "identifier": identifier,
        "lora": lora or "",
        "model": model or "",
        "vllm_version": vllm_version or "",
        "hash_algo": hash_algo or "",
        "created": repr(time.time() if created is None else float(created)),
        "checksum": checksum(view),
    }
    if encoder_config:
        meta["encoder_config"] = str(encoder_config)
    if lora_digest:
        meta["lora_digest"] = str(lora_digest)
    if binding:
        meta["binding"] = str(binding)
    if keyed_by:
        meta["keyed_by"] = str(keyed_by)
    header = {
        "__metadata__": meta,
        TENSOR_KEY: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data on 8 bytes
    return _LEN.pack(len(raw)) + raw, view


def byte_views(parts) -> list[memoryview]:
    """An entry's bytes as flat byte views: ``parts`` is one buffer (bytes, a numpy array,
    a mapping: anything with the buffer protocol) or an iterable of buffers to join."""
    try:
        view = memoryview(parts)
    except TypeError:  # not a buffer: an iterable of them
        return [memoryview(p).cast("B") for p in parts]
    return [view.cast("B")]


def same_version(a: EntryMeta, b: EntryMeta) -> bool:
    """Whether two headers describe the same stored version of an entry: the same bytes
    (checksum, dtype, shape), written at the same time with the same stamps. Every
    producer write makes a new ``created``; a copy (``warm``, ``promote``) keeps it."""
    return (a.checksum == b.checksum and a.created == b.created and a.dtype == b.dtype
            and a.shape == b.shape and a.encoder_config == b.encoder_config
            and a.lora_digest == b.lora_digest and a.binding == b.binding
            and a.identifier == b.identifier)


def encode(identifier: str, data, dtype: str, shape, **meta) -> bytes:
    header, view = encode_parts(identifier, data, dtype, shape, **meta)
    return header + view.tobytes()


def header_length(prefix) -> int:
    """Total header size (8 + JSON) from the first 8 bytes of an entry."""
    if len(prefix) < 8:
        raise CorruptEntry("truncated", "shorter than the 8-byte header length")
    (n,) = _LEN.unpack_from(prefix, 0)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise CorruptEntry("bad-header", f"header length {n}")
    return 8 + n


class _Tensor(msgspec.Struct):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


class _Header(msgspec.Struct, rename={"metadata": "__metadata__", "tensor": TENSOR_KEY}):
    """What encache reads of a safetensors header (other tensors and keys are ignored).
    safetensors metadata holds strings only."""
    tensor: _Tensor
    metadata: dict[str, str] | None = None


_HEADER = msgspec.json.Decoder(_Header)


def parse_header(buf, total_size: int | None = None) -> tuple[EntryMeta, int]:
    """Parse the header at the start of ``buf``; return ``(meta, data_offset)``.

    ``total_size`` (the full entry size, if known) is checked against the tensor's
    byte range, so a truncated file is caught from its header alone. Anything the
    safetensors format does not allow (a metadata value that is not a string, a shape
    that is not integers) is :class:`CorruptEntry`, never another error: one hostile
    file must not stop a listing or a load.
    """
    start = header_length(buf)
    if len(buf) < start:
        raise CorruptEntry("truncated", "header cut short")
    try:
        header = _HEADER.decode(buf[8:start])
    except msgspec.ValidationError as e:
        _raise_if_newer(buf[8:start])  # (a newer format may describe its tensor otherwise)
        raise CorruptEntry("bad-header", f"not a safetensors header of an entry ({e})") from None
    except msgspec.DecodeError:
        raise CorruptEntry("bad-header", "header is not JSON") from None
    md = header.metadata or _NO_EXTRA
    get = md.get
    fmt = get("encache_format")
    if fmt is not None and fmt not in READ_FORMATS:
        raise NewerFormat(f"entry format {fmt!r}")
    recorded = get("checksum")
    if recorded and not recorded.startswith(_CHECKSUM_PREFIXES):
        raise NewerFormat(f"checksum algorithm {recorded.split(':', 1)[0]!r}")
    info = header.tensor
    dtype, shape = info.dtype, tuple(info.shape)
    begin, end = info.data_offsets
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise CorruptEntry("bad-header", f"unknown dtype {dtype!r}")
    if (shape and min(shape) < 0) or not 0 <= begin <= end:
        raise CorruptEntry("bad-header", "negative shape or offsets")
    if prod(shape) * itemsize != end - begin:
        raise CorruptEntry("wrong-shape", f"shape {shape} {dtype} != {end - begin} bytes")
    if total_size is not None and start + end != total_size:
        kind = "truncated" if start + end > total_size else "trailing-bytes"
        raise CorruptEntry(kind, f"expected {start + end} bytes, found {total_size}")
    created = get("created")
    try:
        created = float(created) if created else None
    except ValueError:
        created = None
    # values shared by many entries are interned (one object each, a store's header
    # index pickles them once): model, LoRA, versions, dtype, shape
    meta = EntryMeta(
        identifier=get("identifier") or None, dtype=sys.intern(dtype), shape=_shape(shape),
        data_bytes=end - begin, lora=_intern(get("lora")), model=_intern(get("model")),
        vllm_version=_intern(get("vllm_version")), hash_algo=_intern(get("hash_algo")),
        created=created, checksum=recorded or None,
        format_version=_intern(get("encache_format")),
        encoder_config=sys.intern(get("encoder_config", "")),
        lora_digest=get("lora_digest", ""),
        binding=get("binding", ""),
        keyed_by=sys.intern(get("keyed_by", "")),
        extra=(_NO_EXTRA if md.keys() <= _KNOWN_METADATA
               else {k: v for k, v in md.items() if k not in _KNOWN_METADATA}),
    )
    return meta, start + begin


def _raise_if_newer(raw) -> None:
    """:class:`NewerFormat` when the JSON header ``raw``, which is not one this build
    parses, names an entry format this build does not read in its ``__metadata__``."""
    try:
        md = json.loads(bytes(raw)).get("__metadata__")
        fmt = md.get("encache_format") if isinstance(md, dict) else None
    except (ValueError, AttributeError):
        return
    if isinstance(fmt, str) and fmt not in READ_FORMATS:
        raise NewerFormat(f"entry format {fmt!r}")


_NO_EXTRA: dict = {}  # shared by entries without unknown metadata (never mutated)
_SHAPES: dict = {}


def _intern(value: str | None) -> str | None:
    """``value or None``, interned."""
    return sys.intern(value) if value else None


def _shape(shape: tuple) -> tuple:
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
    return _SHAPES.setdefault(shape, shape)


def validate_blob(blob, *, identifier: str | None = None, verify: bool = True,
                  ahead=None) -> tuple[EntryMeta, int]:
    """Validate a whole entry; return ``(meta, offset of the tensor bytes)``.

    Raises :class:`CorruptEntry` for truncation, a bad header, a shape that does not
    match the byte count, an identifier that is not the one asked for, or (``verify``)
    a checksum mismatch. Legacy entries carry no checksum and are only size-checked.
    ``ahead``: optional, as :func:`read_verified`'s but for bytes already in ``blob`` (a
    mapping: ``read_ahead.start`` with no descriptor): an entry checksummed in pieces is
    hashed on two threads, this one the front :data:`HASHED_FRONT` of the pieces, a
    helper the rest (each thread faults in the pages of a mapping it hashes).
    """
    view = memoryview(blob).cast("B")
    meta, offset = parse_header(view, total_size=view.nbytes)
    if identifier is not None and meta.identifier is not None and meta.identifier != identifier:
        raise CorruptEntry("wrong-identifier", f"entry holds {meta.identifier!r}")
    if verify and meta.checksum is not None:
        end = offset + meta.data_bytes
        if not (_pieces_match(view, offset, end, meta.checksum, ahead)
                if ahead is not None and meta.checksum.startswith(_PIECES_PREFIX)
                else checksum_matches(view[offset:end], meta.checksum)):
            raise CorruptEntry("checksum", "tensor bytes do not match the recorded checksum")
    return meta, offset


def _pieces_match(view: memoryview, begin: int, end: int, recorded: str, ahead) -> bool:
    """Whether the tensor bytes ``view[begin:end]`` match ``recorded`` (an
    ``xxh3_128x512k`` checksum), hashed on two threads when ``ahead`` starts a job for
    the back pieces (:func:`validate_blob`), else on this one."""
    total = -(-(end - begin) // HASH_PIECE)
    pieces = max(1, int(total * HASHED_FRONT))
    job = None
    if pieces < total:
        job = ahead(view, end, begin=begin + pieces * HASH_PIECE, chunk=HASH_PIECE, hash=True)
    if job is None:
        return checksum_matches(view[begin:end], recorded)
    try:
        return _joined_match([xxhash.xxh3_128_digest(view[at:at + HASH_PIECE])
                              for at in range(begin, job.begin, HASH_PIECE)], job, recorded)
    finally:
        job.close()


def _joined_match(front: list, job, recorded: str) -> bool:
    """Whether the digests of the front pieces (``front``, this thread's) and of the
    rest (``job``'s: each hashed by the job, or by this thread as it iterates the job's
    steps) make the ``xxh3_128x512k`` checksum ``recorded``."""
    for _ in job.landed():  # (steps already yielded are not yielded again)
        pass
    return (xxhash.xxh3_128_hexdigest(b"".join(front) + job.digests())
            == recorded[len(_PIECES_PREFIX):])


#: bytes per step of :func:`read_verified` from a file read on one thread (no ``ahead``
#: job): the whole entry up to 4 MiB, then 4 MiB steps. A file's read is a synchronous
#: copy from the page cache, so on one thread nothing overlaps the hash and each step
#: only adds a call; a step this size still sits in the last-level cache when it is
#: hashed. Measured on this machine (2.75 / 10 MB entries): 0.69 / 0.80x a plain
#: ``readinto`` with 4 MiB steps, 0.59 / 0.63x with 256 KiB.
FILE_CHUNK = 4 << 20
#: bytes per step from a socket (a Redis reply): the server keeps sending while a step is
#: hashed, so small steps overlap the hash with the transfer (64 KiB-4 MiB measured: the
#: smallest fastest, within noise up to 256 KiB).
STREAM_CHUNK = 256 << 10


class _PieceHasher:
    """``xxh3_128x512k`` of bytes that arrive in steps of any size (a socket's, a file's):
    each 512 KiB piece's digest as its last byte arrives, a whole piece that arrives in
    one step hashed in one call."""

    __slots__ = ("_piece", "_left", "_digests")

    def __init__(self):
        self._piece = xxhash.xxh3_128()
        self._left = HASH_PIECE  # bytes still to come of the current piece
        self._digests: list[bytes] = []

    def update(self, view) -> None:
        n, pos = view.nbytes, 0
        while pos < n:
            take = min(self._left, n - pos)
            if take == HASH_PIECE:  # (a whole piece in this step)
                self._digests.append(xxhash.xxh3_128_digest(view[pos:pos + take]))
            else:
                self._piece.update(view[pos:pos + take])
                self._left -= take
                if not self._left:
                    self._digests.append(self._piece.digest())
                    self._piece.reset()
                    self._left = HASH_PIECE
            pos += take

    def hexdigest(self) -> str:
        digests = self._digests
        if self._left < HASH_PIECE:  # the last piece, shorter
            digests = digests + [self._piece.digest()]
        return xxhash.xxh3_128_hexdigest(b"".join(digests))


def _hasher(recorded: str):
    algo = recorded.split(":", 1)[0]
    if algo == "xxh3_128x512k":
        return _PieceHasher()
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "blake3":
        return blake3()
    raise NewerFormat(f"checksum algorithm {algo!r}")


#: with a helper (``ahead``): bytes of the first read, which holds the header (a
#: one-tensor header is a few hundred bytes), before the helper's part is chosen
HEAD_STEP = 64 << 10
#: with a helper, of an entry checksummed in pieces: the share of the pieces this thread
#: reads and hashes before it waits for the helper's (it also parses the header, and
#: takes the helper's pieces from the end while the helper reads; read_ahead.py)
HASHED_FRONT = 0.5


def read_verified(readinto, size: int, buf, *, chunk: int, identifier: str | None = None,
                  verify: bool = True, ahead=None) -> tuple[EntryMeta, int]:
    """Read a whole entry of ``size`` bytes into ``buf`` and validate it in the same pass.

    ``readinto(view) -> n`` reads the entry's next bytes into ``view`` (a file's
    ``readinto``, ``os.readv`` on a descriptor, a socket's ``recv_into``); ``buf`` is any
    writable buffer of ``size`` bytes (the buffer the engine will own: a private copy,
    or a pinned staging buffer on a GPU host). Each step is hashed right after it was
    read, while it is still in the CPU cache, so a checksummed first load costs one pass
    over the bytes instead of a read (or page faults) plus a second, hashing pass.
    ``chunk``: bytes per step (:data:`FILE_CHUNK` or :data:`STREAM_CHUNK`).
    ``ahead(view, size, begin=None, chunk=None, hash=False)``: optional, for a source that
    can be read at an offset (a file): starts reading the entry's back part (from
    ``begin``, or where it chooses) into ``view`` on another thread and returns a job
    (:class:`.read_ahead.Job`: its part starts at ``begin``; ``landed()`` yields each of
    its steps' range once it is in; ``digests()``; ``close()``), or None. Then this
    thread reads the front part while the job reads the back. An entry checksummed in
    pieces (``xxh3_128x512k``) is hashed on both threads: the job hashes each piece it
    reads (``hash``), this thread the front's, and the digests are joined. Any other
    checksum is this thread's: it hashes the front, then the job's steps in order as
    they land. (The job is always ended before this returns.)
    Returns ``(meta, offset of the tensor bytes)``; raises :class:`CorruptEntry` as
    :func:`validate_blob` does (``truncated`` when the source ends early)."""
    view = memoryview(buf).cast("B")
    if view.nbytes != size:
        raise ValueError(f"buffer of {view.nbytes} bytes for an entry of {size}")

    def fill(start: int, end: int) -> None:
        while start < end:
            n = readinto(view[start:end])
            if not n:
                raise CorruptEntry("truncated", f"expected {size} bytes, read {start}")
            start += n

    job = None
    pieces = 0  # > 0: the pieces [0, pieces) are this thread's, the rest the job's hashed
    try:
        got = min(size, max(8, chunk if ahead is None else HEAD_STEP))
        fill(0, got)
        need = header_length(view[:got])
        if ahead is not None:
            if verify and need <= got and _PIECES_MARK in view[8:need].tobytes():
                # (a peek: the parsed header decides below; the pieces are the tensor's,
                # which starts right after the header in every entry encache writes)
                total = -(-(size - need) // HASH_PIECE)
                pieces = max(1, int(total * HASHED_FRONT))
                if pieces < total:
                    job = ahead(view, size, begin=need + pieces * HASH_PIECE,
                                chunk=HASH_PIECE, hash=True)
                if job is None:
                    pieces = 0
            else:
                job = ahead(view, size)
        stop = size if job is None else job.begin  # this thread reads bytes [0, stop)
        steps = None if job is None else job.landed()
        if need > got:  # a header longer than the first step
            fill(got, min(stop, need))
            got = min(stop, need)
        while need > got and steps is not None:  # (longer than this thread's part too)
            step = next(steps, None)
            if step is None:
                break
            got = step[1]
        meta, offset = parse_header(view[:got], total_size=size)
        if identifier is not None and meta.identifier is not None and meta.identifier != identifier:
            raise CorruptEntry("wrong-identifier", f"entry holds {meta.identifier!r}")
        if pieces and (offset != need or not (meta.checksum or "").startswith(_PIECES_PREFIX)):
            pieces = 0  # (not the entry the peek took it for: hashed below, in order)
        if pieces:
            digests = []
            for begin in range(offset, stop, HASH_PIECE):
                end = begin + HASH_PIECE
                if end > got:
                    fill(got, end)
                    got = end
                digests.append(xxhash.xxh3_128_digest(view[begin:end]))
            if not _joined_match(digests, job, meta.checksum):
                raise CorruptEntry("checksum", "tensor bytes do not match the recorded checksum")
            return meta, offset
        if job is None and got == size:  # (read in one step: hashed in one call)
            if (verify and meta.checksum is not None
                    and not checksum_matches(view[offset:size], meta.checksum)):
                raise CorruptEntry("checksum", "tensor bytes do not match the recorded checksum")
            return meta, offset
        hasher = _hasher(meta.checksum) if verify and meta.checksum is not None else None
        if hasher is not None and got > offset:
            hasher.update(view[offset:got])
        while got < stop:
            end = min(stop, got + chunk)
            fill(got, end)
            if hasher is not None:
                hasher.update(view[max(got, offset):end])
            got = end
        if steps is not None:
            for begin, end in steps:
                if hasher is not None:
                    hasher.update(view[max(begin, offset):end])
    except EOFError as e:  # (the job's: the file ended early)
        raise CorruptEntry("truncated", f"expected {size} bytes, read {e.args[0]}") from None
    finally:
        if job is not None:
            job.close()
    if hasher is not None and f"{meta.checksum.split(':', 1)[0]}:{hasher.hexdigest()}" != meta.checksum:
        raise CorruptEntry("checksum", "tensor bytes do not match the recorded checksum")
    return meta, offset


def decode(blob, *, identifier: str | None = None, verify: bool = True) -> tuple[EntryMeta, memoryview]:
    """Validate a whole entry and return ``(meta, tensor_bytes_view)`` (no copy)."""
    meta, offset = validate_blob(blob, identifier=identifier, verify=verify)
    return meta, memoryview(blob).cast("B")[offset:offset + meta.data_bytes]
