"""One huge JSONL line read in chunks: its top-level object checked, and one long string value decoded piece by piece.

A 100 MB document on one line, read whole, is held twice at once (the line's bytes, then its decoded text, then
the parsed record's string: each freed once the next exists, ~2 bytes per byte at the peak). Here the line is never
held whole. :class:`LineScan` walks it as a stream of decoded characters (UTF-8 decoded incrementally, so a chunk
may end inside a multibyte character) and builds a *skeleton*: the line with the content of every string longer
than :data:`LONG_STRING_CHARS` replaced by a placeholder (a per-line random nonce, which no input can predict). The
skeleton is small and is parsed by ``json.loads`` itself, so the structure (keys, nested values, duplicates: the last
one wins, as ``json.loads`` does, trailing garbage) and every error message are exactly ``json.loads``'s, at the
column of the line. The content of a long string is checked and decoded region by region by ``json.loads`` too
(``'"' + region + '"'``, regions cut only between escapes and never inside a surrogate pair), so escapes,
``\\uXXXX`` surrogate pairs, control characters and their error messages are again ``json.loads``'s.

Errors come in the order the whole-line path reports them: invalid UTF-8 anywhere in the line first (the byte
column), then the first JSON error of the line (the character column).

Memory stays flat for lines whose bulk is in long strings (documents); a line whose bulk is numbers, or many short
strings, is held in its skeleton (as a ``str``, once).
"""

from __future__ import annotations

import codecs
import io
import json
import re
import secrets
import tempfile
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

__all__ = ["STREAM_LINE_BYTES", "STREAM_CHUNK", "LONG_STRING_CHARS", "LineScan", "LineError", "ScannedLine", "LongLine",
           "long_lines", "long_line_text", "StreamedText", "skip_line", "lone_surrogate", "find_surrogate"]

#: A ``.jsonl`` line longer than this many bytes is streamed when the caller asks for it (``curation.ingest.corpus.
#: iter_documents(stream=True)``): read in chunks, never held whole. Shorter lines take the
#: whole-line path. Module constants: tests make them tiny.
STREAM_LINE_BYTES = 4 << 20
#: Bytes of a streamed line read at once.
STREAM_CHUNK = 1 << 20

#: Strings with more characters than this are not held in the skeleton (module constant: tests make it tiny).
LONG_STRING_CHARS = 1 << 16
_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.isspace() counts: a blank line is skipped as the whole-line path does


class LineError(ValueError):
    """The line is unusable; ``str(e)`` is the reason as the whole-line path words it (no file/line)."""


def not_utf8(byte: int, column: int) -> LineError:
    """The reason for a line that is not UTF-8 (``column`` 1-based), worded once for both paths."""
    return LineError(f"not valid UTF-8 (byte 0x{byte:02x} at column {column})")


def malformed_json(msg: str, column: int) -> LineError:
    """The reason for a line json.loads refuses with ``msg`` at ``column`` (1-based), worded once for both paths."""
    # Some messages end in "at" ("Unterminated string starting at"): the column completes them.
    where = f"{msg} column {column}" if msg.endswith(" at") else f"{msg} at column {column}"
    return LineError(f"malformed JSON ({where})")


#: A surrogate code point: in a Python string it is always a lone half (a JSON ``\\uD83D\\uDE00`` pair is decoded to
#: one character), which is not Unicode text: no tokenizer can encode it (HF tokenizers raise a TypeError).
_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (None: there is none; ASCII text is not searched)."""
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def lone_surrogate(text: str, at: int, offset: int = 0) -> LineError:
    """The reason for a text holding the lone surrogate ``text[at]`` (character ``offset + at + 1`` of the whole text),
    worded once for every reader."""
    return LineError(f"the text holds the lone surrogate \\u{ord(text[at]):04x} (character {offset + at + 1}), which "
                     "is not Unicode text: no tokenizer can encode it")


def _utf8_error(e: UnicodeDecodeError, offset: int) -> LineError:
    return not_utf8(e.object[e.start], offset + e.start + 1)


def _json_error(msg: str, pos: int, newline: int | None = None) -> LineError:
    """json.loads's message; its column counts from the line's final newline (at ``newline``) when past it."""
    return malformed_json(msg, pos - newline if newline is not None and pos > newline else pos + 1)


def _escape_start(buf: str, k: int) -> bool:
    """Whether the backslash at ``buf[k]`` starts an escape (an odd run of backslashes ends at k; ``buf`` starts
    between escapes)."""
    n = 0
    while k >= 0 and buf[k] == "\\":
        n, k = n + 1, k - 1
    return n % 2 == 1


def _safe_cut(buf: str) -> int:
    """A place to end a region of string content ``buf`` (no terminator in it) before more arrives: not inside an
    escape and not between the halves of a ``\\uD8xx\\uDCxx`` pair (either may continue in the next chunk)."""
    r = buf.rfind("\\", max(0, len(buf) - 12))
    if r < 0:
        return len(buf)  # the last 12 characters hold no escape: nothing straddles the end
    q = r
    while q > 0 and buf[q - 1] == "\\":
        q -= 1  # the start of that run of backslashes: a boundary between escapes
    hi = buf[q - 6:q]
    if q >= 6 and hi[:2] == "\\u" and hi[2:3] in ("d", "D") and hi[3:4] in tuple("89abAB") \
            and _escape_start(buf, q - 6):
        q -= 6  # a high surrogate just before: json.loads pairs it with what follows
    return q


@dataclass
class _Long:
    """A string longer than LONG_STRING_CHARS: where it is and whether it holds more than whitespace."""

    quote: int  # character position of its opening quote in the line
    blank: bool = True
    chars: int = 0  # of its content decoded so far
    surrogate: LineError | None = None  # the first lone surrogate in its content

    def check(self, piece: str) -> None:
        """Note what the next decoded ``piece`` of the content holds (any text, a lone surrogate)."""
        self.blank = self.blank and (not piece or piece.isspace())
        if self.surrogate is None and (at := find_surrogate(piece)) is not None:
            self.surrogate = lone_surrogate(piece, at, self.chars)
        self.chars += len(piece)


@dataclass
class ScannedLine:
    """The result of a first pass: the record (long strings as placeholders), or ``blank`` (a line of ASCII
    whitespace, skipped)."""

    record: object
    blank: bool
    longs: list[_Long]
    marker: str

    def long_index(self, value: object) -> int | None:
        """Which long string ``value`` stands for (None: a real value)."""
        if isinstance(value, str) and value.startswith(self.marker):
            return int(value[len(self.marker):])
        return None


class LineScan:
    """One pass over a line's byte chunks. ``run(chunks, emit=i)`` yields the decoded pieces of long string ``i``
    (and stops after it); ``scan(chunks)`` checks the whole line and returns a :class:`ScannedLine`."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.marker = f"\x00{self.nonce}:"

    def scan(self, chunks: Iterator[bytes]) -> ScannedLine:
        longs: list[_Long] = []
        skeleton = "".join(self._walk(chunks, longs, None))
        if self._utf8 is not None:
            raise self._utf8
        if self._json is not None:
            # An error in a long string's content; one in the skeleton before that string's opening quote comes first.
            error, quote = self._json
            try:
                json.loads(skeleton + '"')
            except json.JSONDecodeError as e:
                pos = self._line_pos(e.pos, self._shifts)
                if pos <= quote:
                    raise _json_error(e.msg, pos, self._newline) from None
            raise error
        if not skeleton.strip(_ASCII_SPACE) and not longs:
            return ScannedLine(None, True, longs, self.marker)
        try:
            record = json.loads(skeleton)
        except json.JSONDecodeError as e:
            raise _json_error(e.msg, self._line_pos(e.pos, self._shifts), self._newline) from None
        return ScannedLine(record, False, longs, self.marker)

    def pieces(self, chunks: Iterator[bytes], index: int) -> Iterator[str]:
        """The decoded content of long string ``index`` (after a successful :meth:`scan` of the same bytes)."""
        self._whole = False
        yield from self._walk(chunks, [], index)
        if self._utf8 is not None or self._json is not None:
            raise self._utf8 or self._json[0]
        if not self._whole:
            raise LineError(f"has no long string {index} any more")

    @staticmethod
    def _line_pos(pos: int, shifts: list[tuple[int, int]]) -> int:
        """A skeleton position as a character position of the line."""
        return pos + sum(delta for at, delta in shifts if pos >= at)

    def _walk(self, chunks: Iterator[bytes], longs: list[_Long], emit: int | None) -> Iterator[str]:
        """Skeleton parts (``emit`` None) or the pieces of long string ``emit``; sets ``self._utf8`` (the line's
        first invalid UTF-8), ``self._json`` (the first error in a long string's content, with that string's opening
        quote) and ``self._shifts`` (skeleton position → line position). The strings' state: :class:`_Walk`."""
        self._utf8: LineError | None = None
        self._json: tuple[LineError, int] | None = None
        self._shifts: list[tuple[int, int]] = []
        self._newline: int | None = None  # the position of the line's final newline
        decoder = codecs.getincrementaldecoder("utf-8")()
        walk = _Walk(self, longs, emit)
        fed = 0  # bytes given to the decoder
        json_err: LineError | None = None
        done = False
        stream = iter(chunks)
        while not done:
            data = next(stream, None)
            final = data is None
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(b"" if final else data, final=final)
            except UnicodeDecodeError as e:
                self._utf8 = _utf8_error(e, fed - pending)
                return
            fed += 0 if final else len(data)
            done = final
            if json_err is not None:
                continue  # only looking for invalid UTF-8 further on
            try:
                if (yield from walk.text(text, final)):
                    self._whole = True
                    return  # all of long string `emit` emitted
            except _Partial:  # the line ended inside a short string: json.loads reports it from the skeleton
                yield walk.partial()
            except LineError as e:
                json_err = e
                self._json = (e, walk.quote)
            walk.pos += len(text)
            if text:
                self._newline = walk.pos - 1 if text.endswith("\n") else None


class _Walk:
    """The strings of one :meth:`LineScan._walk`: where the walk is in the line and in the skeleton, the string it is
    in (its opening quote, its content while it may still be short, the long string it became), the long strings
    met. Its methods yield what the walk yields (skeleton parts, or the pieces of long string ``emit``)."""

    def __init__(self, scan: LineScan, longs: list[_Long], emit: int | None) -> None:
        self.scan, self.longs, self.emit = scan, longs, emit
        self.pos = 0  # characters of the line before the text in hand
        self.skel = 0  # characters of the skeleton yielded so far
        self.in_str = False
        self.content: list[str] = []  # a string's content while it may still be short
        self.held = 0
        self.quote = 0  # line position of the current string's opening quote
        self.cur: _Long | None = None
        self.n_long = 0
        self.carry = ""  # string content not decided yet (starts between escapes)

    def region(self, raw: str, at: int, closed: bool = True) -> str:
        """Decode string content ``raw`` (starting at line position ``at``); not ``closed``: the line ends
        there, inside the string (json.loads reports how, e.g. a \\uXXXX escape cut short)."""
        try:
            return json.loads('"' + raw + ('"' if closed else ""))
        except json.JSONDecodeError as e:
            if e.msg.startswith("Unterminated string"):  # content ending in a lone backslash
                raise _json_error(e.msg, self.quote) from None
            raise _json_error(e.msg, at - 1 + e.pos) from None

    def text(self, text: str, final: bool) -> Generator[str, None, bool]:
        """Walk the decoded ``text`` (``final``: the line's last); ``True`` once long string ``emit`` is whole.

        Raises:
            _Partial: the line ended inside a short string.
            LineError: an error in a long string's content.
        """
        i = 0
        while i < len(text) or (final and self.in_str):
            if not self.in_str:
                i = yield from self._outside(text, i)
                continue
            i, then = yield from self._inside(text, i, final)
            if then == "whole":
                return True
            if then == "next text":
                break
        return False

    def _outside(self, text: str, i: int) -> Generator[str, None, int]:
        """Skeleton up to the next opening quote (which starts a string), or to the text's end; where to go on."""
        j = text.find('"', i)
        if j < 0:
            if self.emit is None:
                self.skel += len(text) - i
                yield text[i:]
            return len(text)
        if self.emit is None:
            self.skel += j + 1 - i
            yield text[i:j + 1]
        self.in_str, self.quote, self.content, self.held, self.cur, self.carry = True, self.pos + j, [], 0, None, ""
        return j + 1

    def _inside(self, text: str, i: int, final: bool) -> Generator[str, None, tuple[int, str]]:
        """Inside a string: its content up to its terminator (a quote not escaped) or the text's end; where to go on,
        and how: ``"go on"``, ``"next text"`` (the string goes on in the next text), ``"whole"``."""
        buf = self.carry + text[i:]
        start = self.pos + i - len(self.carry)  # line position of buf[0]
        k = buf.find('"')
        while k >= 0 and k > 0 and _escape_start(buf, k - 1):
            k = buf.find('"', k + 1)
        if k < 0 and not final:
            cut = _safe_cut(buf)
            raw, self.carry, i = buf[:cut], buf[cut:], len(text)
        else:
            end = len(buf) if k < 0 else k
            raw, self.carry = buf[:end], ""
            i = len(text) - (len(buf) - end) + (0 if k < 0 else 1)
        yield from self._content(raw, start, closed=k >= 0 or not final)
        if k < 0 and not final:
            return i, "next text"
        # the string ended (or the line did, inside it)
        if k < 0:
            raise _Partial()  # a long string's region() has raised already
        self.in_str = False
        whole = yield from self._string_end(i)
        return i, "whole" if whole else "go on"

    def _content(self, raw: str, start: int, *, closed: bool) -> Iterator[str]:
        """A piece ``raw`` of the string's content (at line position ``start``): held while the string may still be
        short; else decoded (and emitted, when it is long string ``emit``)."""
        if self.cur is None and self.held + len(raw) <= LONG_STRING_CHARS:
            self.content.append(raw)
            self.held += len(raw)
            return
        if self.cur is None:  # it became long: what was held is checked (and emitted) first
            self.cur = _Long(self.quote)
            first, self.content = "".join(self.content), []
            self.longs.append(self.cur)
            parts = ((first, self.quote + 1, True), (raw, start, closed))
        else:
            parts = ((raw, start, closed),)
        for part, at, part_closed in parts:
            piece = self.region(part, at, part_closed)
            self.cur.check(piece)
            if self.emit == self.n_long:
                yield piece

    def _string_end(self, i: int) -> Generator[str, None, bool]:
        """The string closed (its quote just before text position ``i``): a short one goes to the skeleton, a long
        one's stand-in; ``True`` when it was long string ``emit`` (all of it emitted)."""
        if self.cur is None:
            if self.emit is None:
                s = "".join(self.content) + '"'
                self.skel += len(s)
                yield s
        else:
            if self.emit == self.n_long:
                return True
            stand_in = json.dumps(f"{self.scan.marker}{self.n_long}")[1:]  # escaped, with the closing quote
            if self.emit is None:
                self.skel += len(stand_in)
                self.scan._shifts.append((self.skel, (self.pos + i - 1 - (self.quote + 1)) - (len(stand_in) - 1)))
                yield stand_in
            self.n_long += 1
        self.content, self.cur = [], None
        return False

    def partial(self) -> str:
        """The content of the short string the line ended in (the skeleton's last part; json.loads reports it)."""
        s = "".join(self.content)
        self.skel += len(s)
        self.in_str = False
        return s


class _Partial(Exception):
    """A short string unterminated at the line's end (reported by json.loads from the skeleton)."""


@dataclass
class StreamedText:
    """The text field of a huge line: its pieces are decoded from the line again when asked for."""

    chunks: Callable[[], Iterator[bytes]]  # the line's bytes, read anew
    index: int  # which long string of the line

    def pieces(self) -> Iterator[str]:
        return LineScan().pieces(self.chunks(), self.index)


@dataclass
class LongLine:
    """A line longer than :data:`STREAM_LINE_BYTES`, not read into memory: its bytes are read again, in chunks, each
    time they are needed (from the file, or from a temporary copy for a ``.jsonl.zst`` file, whose decompression
    cannot seek)."""

    path: str
    offset: int  # of the line in the (decompressed) file
    length: int
    spool: object | None = None  # a temporary file holding the line (zstd)

    def chunks(self) -> Iterator[bytes]:
        if self.spool is not None:
            f, close = self.spool, False
            f.seek(0)
        else:
            f, close = open(self.path, "rb"), True  # noqa: SIM115 - closed in finally
            f.seek(self.offset)
        try:
            left = self.length
            while left > 0:
                try:
                    data = f.read(min(left, STREAM_CHUNK))
                except OSError as e:  # a read error (EIO) names the input
                    e.filename = e.filename or self.path
                    raise
                if not data:
                    raise LineError(f"the file ends {left} bytes early")
                left -= len(data)
                yield data
        finally:
            if close:
                f.close()


def long_lines(stream: io.BufferedIOBase, path: str, fmt: str, pos: int) -> Iterator[bytes | LongLine]:
    """The lines of ``stream`` (at byte ``pos``), those longer than STREAM_LINE_BYTES as :class:`LongLine` s: the
    rest of such a line is read through in chunks (into a temporary copy for a zstd file)."""
    limit = STREAM_LINE_BYTES
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            pos += len(line)
            held = [line]
            del line
            yield held.pop()
            continue
        spool = tempfile.TemporaryFile() if fmt == "jsonl.zst" else None  # noqa: SIM115 - closed by its owner
        length = 0
        while line:
            if spool is not None:
                spool.write(line)
            length += len(line)
            if line.endswith(b"\n"):
                break
            line = stream.readline(STREAM_CHUNK)
        del line
        if spool is not None:
            spool.flush()
        yield LongLine(path, pos, length, spool)
        pos += length


def long_line_text(line: LongLine, text_field: str) -> StreamedText | object | None:
    """A huge line checked whole in one streaming pass: None (a blank line), a :class:`StreamedText` (its text field
    is a long string, decoded again piece by piece when read), or the record (its long strings as placeholders) for
    the caller's checks of a short or missing text field.

    Raises:
        LineError: the same reason as the whole-line path (invalid UTF-8, malformed JSON, an empty document, a lone
            surrogate in the text).
    """
    scanned = LineScan().scan(line.chunks())
    if scanned.blank:
        return None
    record = scanned.record
    if isinstance(record, dict) and text_field in record:
        index = scanned.long_index(record[text_field])
        if index is not None:
            if scanned.longs[index].blank:
                raise LineError("empty document")
            if scanned.longs[index].surrogate is not None:
                raise scanned.longs[index].surrogate
            return StreamedText(line.chunks, index)
    return record


def skip_line(f: io.BufferedIOBase) -> None:
    """Move ``f`` past the end of the line it is in, STREAM_CHUNK bytes at a time: a work unit that starts (or ends)
    inside a 100 MB line must not read the rest of it into memory (``f.readline()`` did, once per unit)."""
    while (part := f.readline(STREAM_CHUNK)) and not part.endswith(b"\n"):
        pass
