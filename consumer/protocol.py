"""The collector protocol: what a SocketSink and the collector say to each other over TCP.

The sender speaks the record stream ("Record stream format"): a header frame opens the
connection (the handshake: run, process, sender, first sequence number and, if required, the
token), then come record frames, and empty frames as heartbeats while it has nothing to send.
The collector answers in numbers: an acknowledgement (a uint64: the records received on this
connection so far) after each batch it wrote, or, before it hangs up on purpose, a refusal:

    REFUSED (8 bytes ff)  uint32 length  UTF-8 text  uint16 code  uint64 limit

The code says why (``Reason``; numbers are never reused), ``limit`` is the collector's limit the
refusal is about (the largest record it takes, for RECORD_TOO_LARGE) or 0, and the text is made
from the code here, for people (and for senders older than the codes, which read only the text).
A sender decides by the code alone; a code it does not know is still a refusal, reported with
its number and text.

Both sides use this module, so they cannot disagree on a number. It never does I/O: the
collector (asyncio) and SocketSink (a thread) move the bytes it describes.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import re
import struct
from typing import Any

from .stream import (
    FORMAT,
    FRAME,
    RECORD_START,
    SYNC,
    VERSION,
    frame_item,
    stream_header,
    unpack_item,
)

# The collector's answer after each batch it wrote: records received on the connection so far.
ACK = struct.Struct("<Q")
# An acknowledgement no connection reaches: a refusal follows.
REFUSED = (1 << 64) - 1
# The length of a refusal's text, which follows it.
REASON = struct.Struct("<I")
# The longest refusal text: the collector's are a sentence, so a sender takes a longer length for
# a broken or hostile peer, never for something to read (it would read up to 4 GiB).
MAX_REFUSAL_TEXT = 64 << 10
# After the text: the refusal's code and the limit it names.
REFUSAL_CODE = struct.Struct("<HQ")
# An empty frame: SocketSink sends one when idle, so the collector knows it is alive. The
# collector never writes it to a run file.
HEARTBEAT = FRAME.pack(SYNC, 0, 0)
# The shared token a collector may require; SocketSink presents it in its stream header.
TOKEN_VARIABLE = "HOSTCALLBACK_COLLECTOR_TOKEN"
# The msgpack types of a map: a record frame's payload starts with one.
_MAP_TYPES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


class Reason(enum.IntEnum):
    """Why the collector hangs up on a sender. The numbers are the wire's: a new reason gets a
    new number, and no number is ever reused for another meaning."""

    NO_CODE = 0  # a refusal without a code: from a collector older than the codes
    NOT_A_STREAM = 1
    NO_SENDER = 2
    VERSION = 3
    TOKEN = 4
    HEADER_TOO_LARGE = 5
    RECORD_TOO_LARGE = 6  # final for one record: the sender drops it and goes on
    TOO_MANY_CLIENTS = 7
    NOT_A_FRAME = 8
    BAD_CRC = 9
    NOT_A_RECORD = 10
    HEADER_STALLED = 11
    RECORD_STALLED = 12
    ACKNOWLEDGEMENTS_UNREAD = 13
    IDLE = 14
    NO_HEADER = 15
    WRITE_FAILED = 16
    SHUTTING_DOWN = 17
    RECORD_TOO_SLOW = 18  # a record trickled in: bytes came, but never the whole record


# The English text of each reason; ``{limit}`` is the refusal's limit, the other fields are
# given where it is made.
_TEXTS = {
    Reason.NOT_A_STREAM: "the first frame is not a hostcallback stream header",
    Reason.NO_SENDER: "the stream header has no sender and first sequence",
    Reason.VERSION: "stream version {version} is not supported by this collector (it takes "
                    f"version {VERSION}: upgrade the sender)",
    Reason.TOKEN: f"wrong or missing token (set {TOKEN_VARIABLE} or SocketSink(token=...) to "
                  "the collector's token)",
    Reason.HEADER_TOO_LARGE: "a header of {size} bytes is over the collector's limit of {limit} "
                             "bytes",
    Reason.RECORD_TOO_LARGE: "a record of {size} bytes is over the collector's limit of {limit} "
                             "bytes",
    Reason.TOO_MANY_CLIENTS: "the collector already serves {limit} clients (its limit)",
    Reason.NOT_A_FRAME: "bytes that are not a stream frame",
    Reason.BAD_CRC: "a frame whose CRC-32 does not match",
    Reason.NOT_A_RECORD: "a frame that is not a record (a record is a map whose first key is "
                         "'name')",
    Reason.HEADER_STALLED: "no whole stream header within {seconds} s",
    Reason.RECORD_STALLED: "no bytes for {seconds} s in the middle of a record",
    Reason.ACKNOWLEDGEMENTS_UNREAD: "it read no acknowledgements for {seconds} s",
    Reason.IDLE: "no record or heartbeat for {seconds} s",
    Reason.NO_HEADER: "closed before sending a stream header",
    Reason.WRITE_FAILED: "the collector cannot write {path}: {error}",
    Reason.SHUTTING_DOWN: "the collector is shutting down",
    Reason.RECORD_TOO_SLOW: "no whole record within {seconds} s of its first byte",
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refusal as it travels: its code, its text, and the limit it names (or 0)."""

    code: int
    text: str
    limit: int = 0

    @classmethod
    def of(cls, reason: Reason, limit: int = 0, **fields: Any) -> Refusal:
        """The refusal for ``reason``, its text filled in from ``limit`` and ``fields``."""
        return cls(int(reason), _TEXTS[reason].format(limit=limit, **fields), limit)

    @property
    def reason(self) -> Reason | None:
        """The code as a Reason; None for a code this version does not know (a newer collector)."""
        try:
            return Reason(self.code)
        except ValueError:
            return None

    def pack(self) -> bytes:
        """The bytes the collector sends before it hangs up."""
        text = self.text.encode()[:MAX_REFUSAL_TEXT]
        return (ACK.pack(REFUSED) + REASON.pack(len(text)) + text
                + REFUSAL_CODE.pack(self.code, self.limit))

    @staticmethod
    def size_of(data: bytes | bytearray) -> int:
        """How many bytes the refusal at the start of ``data`` takes, as far as ``data`` tells:
        read until ``data`` holds this many (or the connection ends)."""
        if len(data) < ACK.size + REASON.size:
            return ACK.size + REASON.size
        return ACK.size + REASON.size + REASON.unpack_from(data, ACK.size)[0] + REFUSAL_CODE.size

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> Refusal:
        """The refusal at the start of ``data`` (which starts with REFUSED), from what arrived:
        without its code (a collector older than the codes, or cut short) its code is NO_CODE."""
        start = ACK.size + REASON.size
        if len(data) < start:
            return cls(Reason.NO_CODE, "")
        end = start + REASON.unpack_from(data, ACK.size)[0]
        text = bytes(data[start:end]).decode("utf-8", "replace")
        if len(data) < end + REFUSAL_CODE.size:
            # A collector older than the codes says a record is too large only in words.
            too_large = _OLD_TOO_LARGE.search(text)
            if too_large:
                return cls(Reason.RECORD_TOO_LARGE, text, int(too_large.group(1)))
            return cls(Reason.NO_CODE, text)
        code, limit = REFUSAL_CODE.unpack_from(data, end)
        return cls(code, text, limit)

    def describe(self) -> str:
        """What the sender says about it: the text, and the code where this version does not
        know it."""
        if self.reason is None:
            return (f"the collector refused this sink with reason code {self.code}, which this "
                    "version of hostcallback does not know (the collector is newer: upgrade "
                    f"hostcallback on this host to match it); it says: {self.text or '(nothing)'}")
        return f"the collector refused this sink: {self.text}" if self.text else \
            "the collector refused this sink"


# How a collector older than the codes words RECORD_TOO_LARGE (the text above still is so worded).
_OLD_TOO_LARGE = re.compile(r"a record of \d+ bytes is over the collector's limit of (\d+) bytes")


class Refuse(Exception):
    """Raised where the collector decides to hang up on a sender; carries the Refusal it sends."""

    def __init__(self, reason: Reason, limit: int = 0, **fields: Any) -> None:
        self.refusal = Refusal.of(reason, limit, **fields)
        super().__init__(self.refusal.text)


def is_record(payload: bytes | memoryview) -> bool:
    """Whether a sender's frame (not the first) holds a record: a map whose first key is
    "name". Only records may follow the header: a header among them could forge another
    sender or source."""
    return len(payload) >= 6 and payload[0] in _MAP_TYPES and bytes(payload[1:6]) == RECORD_START


# ---- the handshake -----------------------------------------------------------------------------


def sender_header(*, run: str, process: int, sender: str, first: int,
                  token: str | None) -> bytes:
    """The framed header that opens a sender's connection: ``first`` is the sequence number of
    the first record it sends on it (its count of acknowledged records)."""
    header = stream_header(run=run, process=process, sender=sender, first=first)
    if token:
        header["token"] = token
    return frame_item(header)


def check_sender_header(payload: bytes, token: bytes | None) -> dict[str, Any]:
    """The header a sender opened its connection with, checked: a stream header of the version
    the collector takes, with the token when ``token`` is set, a sender id and its first sequence
    number. Raises Refuse otherwise."""
    try:
        header = unpack_item(payload)
    except Exception:  # noqa: BLE001 (any undecodable header is simply not one)
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Refuse(Reason.NOT_A_STREAM)
    if header.get("version") != VERSION:
        raise Refuse(Reason.VERSION, version=header.get("version"))
    if token is not None:
        given = header.get("token")
        given = given.encode() if isinstance(given, str) else b""
        if not hmac.compare_digest(given, token):
            raise Refuse(Reason.TOKEN)
    if not isinstance(header.get("sender"), str) or not isinstance(header.get("first"), int):
        raise Refuse(Reason.NO_SENDER)
    return header
