"""Row sources: a file or hub split, indexed but not read, so a dataset of millions of rows costs little
memory and start-up time.

- JSONL: an index of where each line starts and ends (numpy arrays, 16 bytes a row); a row is read and
  parsed when it is asked for, so it is exactly the dict `json.loads` makes of its line.
- A .json file holding one JSON array of objects (as `datasets` reads one): parsed whole at start-up; a row is
  an element. A .json file of JSON Lines is read as JSONL.
- CSV: the same index of record boundaries (found with the csv module, so quoted fields may span lines);
  a row is the dict `csv.DictReader` makes of its record (one with as many values as the header has fields).
- Parquet and hub splits: `datasets`' Arrow tables, memory-mapped from its cache; a row is `dataset[i]`.
- A folder written by `Dataset.save_to_disk`: loaded with `datasets.load_from_disk` (memory-mapped, as above);
  a `DatasetDict`'s folder is refused, naming its splits' folders.

A source has len(source), source.row(i) -> dict, source.line(i) -> the row's line in the file (or None),
source.iter_rows() -> (i, row or Unreadable) in order; `path` labels errors. data.py builds prompt sets
on them.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import os
import re
import sys
import weakref
from array import array
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from . import hub

_CHUNK = 8 << 20       # bytes read at a time when indexing a file
_BOM = b"\xef\xbb\xbf"   # UTF-8 byte order mark, which Windows editors and Excel put first
# The csv module refuses a field over 131,072 characters, and with it the whole file (a long prompt, a test case):
# its limit is raised to this (a C long on every platform); what a row may hold is data.max_prompt_tokens' to say.
_CSV_FIELD_LIMIT = 2**31 - 1


class DataError(Exception):
    pass


class DataChanged(DataError):
    """A file changed on disk after it was indexed: its offsets no longer fit, so no row can be trusted."""


class DataSettingsError(DataError):
    """A data setting that no row can meet (a chat template the tokenizer lacks): an error, never a row's skip."""


class Unreadable(Exception):
    """A row that cannot be parsed (bad JSON, not an object, not UTF-8): why, for the caller to place."""


# ----------------------------------------------------------------------------------------------------
# Sources: len(source), source.row(i) -> dict, source.line(i) -> the row's line in the file (or None),
# source.iter_rows() -> (i, row or Unreadable) in order. `path` labels errors.
# ----------------------------------------------------------------------------------------------------

def _pread(fd: int, n: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, n, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


class _File:
    """An open file read by offset. The descriptor stays open (closed with the object), so a file replaced
    by a new one (a rename) is still read from the version indexed; one changed in place is an error."""

    def __init__(self, path: Path, label: str):
        self.path = label
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        weakref.finalize(self, os.close, self._fd)
        st = os.fstat(self._fd)
        self._stamp = (st.st_size, st.st_mtime_ns)
        self.size = st.st_size

    def read(self, start: int, end: int) -> bytes:
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise DataChanged(f"{self.path}: the file changed on disk after it was indexed at start-up; restart the "
                              "run (or write new data to a new file): --resume continues from the last checkpoint; a "
                              "changed row count changes the prompt order from there")
        return _pread(self._fd, end - start, start)

    # Subclasses index the file into _starts / _ends (byte span of each row) and parse a span (_parse).
    def __len__(self) -> int:
        return int(self._starts.size)

    def row(self, i: int) -> dict:
        return self._parse(self.read(int(self._starts[i]), int(self._ends[i])))

    def line(self, i: int) -> int:
        return self.line_of(int(self._starts[i]))

    def iter_rows(self, block: int = 4096) -> Iterator[tuple[int, object]]:
        """(i, row or Unreadable) in order, reading a block of rows at a time."""
        for a in range(0, len(self), block):
            b = min(a + block, len(self))
            base = int(self._starts[a])
            data = self.read(base, int(self._ends[b - 1]))
            for i, s, e in zip(range(a, b), (self._starts[a:b] - base).tolist(), (self._ends[a:b] - base).tolist()):
                try:
                    yield i, self._parse(data[s:e])
                except Unreadable as exc:
                    yield i, exc

    def line_of(self, offset: int) -> int:
        """1-based line of the byte at `offset`, counting line ends as text mode does (\\n, \\r\\n, \\r)."""
        count, pos, prev_cr = 0, 0, False
        while pos < offset:
            chunk = _pread(self._fd, min(_CHUNK, offset - pos), pos)
            if not chunk:
                break
            count += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if prev_cr and chunk[:1] == b"\n":  # a \r\n split across two chunks: one line end, counted twice
                count -= 1
            prev_cr = chunk[-1:] == b"\r"
            pos += len(chunk)
        return count + 1


# First bytes that may start a blank line: ASCII whitespace str.strip() removes, and any non-ASCII byte
# (Unicode whitespace); only such lines are decoded to check.
_MAYBE_BLANK = np.zeros(256, dtype=bool)
_MAYBE_BLANK[list(b" \t\x0b\x0c\x1c\x1d\x1e\x1f")] = True
_MAYBE_BLANK[0x80:] = True


class _JsonlSource(_File):
    """One JSON object a line; blank lines are not rows. Lines end at \\n, \\r\\n or \\r, as when the file is
    read in text mode (a \\r\\n makes an empty line between its two bytes, which is blank, so not a row)."""

    def __init__(self, path: Path, label: str, limit: Optional[int] = None):
        super().__init__(path, label)
        self._starts, self._ends = self._index(limit)
        self._not_json_lines()

    def _not_json_lines(self) -> None:
        """A file-level error for a JSON document in place of JSON Lines (a .json export as one array, or one
        object pretty-printed over lines): otherwise every line would be a bad row, or worse, a few would parse."""
        if not len(self):
            return
        first = self.read(int(self._starts[0]), int(self._ends[0]))
        try:
            self._parse(first)
        except Unreadable:
            head = first.strip()
            try:  # an array of rows on one line; a list of plain values is only a bad row
                rows_on_one_line = any(isinstance(r, dict) for r in json.loads(head)) if head[:1] == b"[" else False
            except (ValueError, TypeError, RecursionError):  # (ValueError: bad JSON, or an integer too long)
                rows_on_one_line = False
            if head in (b"[", b"{") or rows_on_one_line:
                what = "an object spread over several lines" if head == b"{" else "an array"
                also = "; or name it .json, which may hold one JSON array of row objects" if head != b"{" else ""
                raise DataError(f"{self.path}: holds one JSON document ({what}), not JSON Lines; expected one JSON "
                                'object per line, e.g. {"prompt": "...", "answer": "..."}' + also) from None

    def _index(self, limit: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
        starts, ends, maybe = [], [], []
        # a leading BOM is not part of the first row (json.loads refuses it)
        pos = line_start = len(_BOM) if _pread(self._fd, len(_BOM), 0) == _BOM else 0
        rows = 0
        while pos < self.size:
            chunk = _pread(self._fd, _CHUNK, pos)
            if not chunk:
                break
            a = np.frombuffer(chunk, dtype=np.uint8)
            br = np.flatnonzero((a == 10) | (a == 13))
            if br.size:
                s = np.empty(br.size, dtype=np.int64)
                s[0], s[1:] = line_start, br[:-1] + 1 + pos
                e = br.astype(np.int64) + pos
                keep = e > s
                s, e = s[keep], e[keep]
                first = np.empty(s.size, dtype=np.uint8)
                inside = s >= pos
                first[inside] = a[s[inside] - pos]
                if s.size and not inside[0]:  # the line began in an earlier chunk
                    first[0] = _pread(self._fd, 1, int(s[0]))[0]
                starts.append(s), ends.append(e), maybe.append(_MAYBE_BLANK[first])
                rows += int(s.size - maybe[-1].sum())
                line_start = int(br[-1]) + 1 + pos
            pos += len(chunk)
            if limit is not None and rows >= limit:  # enough rows that are surely not blank
                break
        else:
            if line_start < pos:  # a last line with no line end
                starts.append(np.array([line_start], dtype=np.int64))
                ends.append(np.array([pos], dtype=np.int64))
                maybe.append(_MAYBE_BLANK[np.frombuffer(_pread(self._fd, 1, line_start), dtype=np.uint8)])
        if not starts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        s, e, m = np.concatenate(starts), np.concatenate(ends), np.concatenate(maybe)
        blank = [i for i in np.flatnonzero(m).tolist()
                 if not _pread(self._fd, int(e[i] - s[i]), int(s[i])).decode("utf-8", "replace").strip()]
        if blank:
            keep = np.ones(s.size, dtype=bool)
            keep[blank] = False
            s, e = s[keep], e[keep]
        return s[:limit], e[:limit]

    @staticmethod
    def _parse(data: bytes) -> dict:
        try:
            row = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise Unreadable(f"not valid UTF-8 ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise Unreadable(f"not valid JSON ({exc.msg})") from None
        except ValueError as exc:  # valid JSON that Python will not read: an integer over its digit limit
            raise Unreadable(_json_value_error(exc)) from None
        except RecursionError:
            raise Unreadable("not readable JSON (nested too deeply)") from None
        if not isinstance(row, dict):
            raise Unreadable(f"expected a JSON object, got {type(row).__name__}")
        return row


def _json_value_error(exc: ValueError) -> str:
    """A row's text for a ValueError json.loads raised that is no JSONDecodeError: Python's limit on the digits of
    an integer read from text (sys.set_int_max_str_digits; 4300 by default)."""
    if "digits" in str(exc):
        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else None
        return (f"holds an integer of more than {limit or 'the allowed'} digits, which Python will not read (its limit "
                "on the digits of a number read from text); write such a number as text, in quotes")
    return f"not readable JSON ({exc})"


_LINE_END = re.compile(rb"\r\n|\r|\n")
_LINE_END_TEXT = re.compile(r"\r\n|\r|\n")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")   # a byte that is not UTF-8, as decoding with surrogateescape keeps it


def _lines(read, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream with their ends, split as text mode with newline='' does."""
    buf = b""
    while True:
        data = read(chunk)
        if not data:
            break
        buf += data
        stop = len(buf) - 1 if buf.endswith(b"\r") else len(buf)  # a last \r may be half of a \r\n
        start = 0
        for m in _LINE_END.finditer(buf, 0, stop):
            yield buf[start:m.end()]
            start = m.end()
        buf = buf[start:]
    if buf:
        yield buf


class _CsvSource(_File):
    """A header line, then records; a row maps the header's fields to the record's values (all strings). A
    record with more or fewer values than the header has fields is unreadable: DictReader would file the extras
    under the key None, which no field names, or make the missing fields None, so a value shifted by an unquoted
    comma or line break would pass unnoticed, or be blamed on the field it left empty."""

    def __init__(self, path: Path, label: str, limit: Optional[int] = None):
        super().__init__(path, label)
        if csv.field_size_limit() < _CSV_FIELD_LIMIT:   # process-wide: only ever raised
            csv.field_size_limit(_CSV_FIELD_LIMIT)
        starts, ends = array("q"), array("q")
        pos = [0]

        def decoded(f):
            for raw in _lines(f.read):
                pos[0] += len(raw)
                # a leading BOM would otherwise become part of the first column's name. A byte that is not UTF-8
                # is kept as a lone surrogate (never a comma, quote or line end, so the records' bounds hold): the
                # record is then a bad row when read, as a JSONL line is, not the whole file's error (found by a
                # red team)
                yield raw.decode("utf-8-sig" if pos[0] == len(raw) else "utf-8", "surrogateescape")

        with open(path, "rb") as f:
            reader = csv.reader(decoded(f))
            try:
                self._fields = next(reader, None) or []
                record = self._fields
                if pos[0] == self.size:   # the header runs to the end: it may be a quote that never closes
                    self._unclosed_quote(label, 0, record)
                self._check_header(label)
                prev = pos[0]
                for record in reader:
                    if record:  # DictReader skips empty records (blank lines)
                        starts.append(prev)
                        ends.append(pos[0])
                        if limit is not None and len(starts) >= limit:
                            break
                    prev = pos[0]
            except csv.Error as exc:
                raise DataError(f"{label}:{reader.line_num}: not valid CSV ({exc})") from None
        if starts and ends[-1] == self.size:
            self._unclosed_quote(label, starts[-1], record)
        self._starts, self._ends = np.frombuffer(starts, dtype=np.int64), np.frombuffer(ends, dtype=np.int64)

    def _unclosed_quote(self, label: str, start: int, record: list) -> None:
        """A file-level error for a record (from byte `start` to the end of the file) whose last quoted value never
        closes its quote. The csv module ends such a value at the end of the file, so every line after the quote
        became one value of one record, which was then blamed as a row with a null field, and with on_bad_row: skip
        the rest of the file was lost unnoticed (found by a red team). Strict parsing tells it ("unexpected end of
        data"); its other complaint, text after a closing quote, stays allowed, as in the first reading."""
        offset = [start]

        def read(n: int) -> bytes:
            data = _pread(self._fd, n, offset[0])
            offset[0] += len(data)
            return data

        lines = (raw.decode("utf-8-sig" if start == 0 else "utf-8", "surrogateescape") for raw in _lines(read))
        try:
            next(csv.reader(lines, strict=True), None)
            return
        except csv.Error as exc:
            if "unexpected end of data" not in str(exc):
                return
        # the open value runs from its quote to the end of the file, so its own line ends place the quote
        last = self.line_of(self.size)
        opened = last - len(_LINE_END_TEXT.findall(record[-1] if record else ""))
        if _pread(self._fd, 1, self.size - 1) in (b"\n", b"\r"):   # a last line end starts no line
            last -= 1
        n = last - opened
        swallowed = f", swallowing the {n} line{'s' * (n != 1)} after it into one value" if n else ""
        raise DataError(f"{label}:{opened}: a quoted value opens on this line and its quote never closes, so it runs "
                        f"to the end of the file (line {last}){swallowed}; close the quote (a quote inside a quoted "
                        'value is written twice: "")')

    def _check_header(self, label: str) -> None:
        """A header that does not name the fields meant is the file's error: bytes that are not UTF-8, one field
        holding ; or tab, a field named twice (only its last column's value would be kept), a name with spaces
        around it. (A blank name is allowed once: pandas' to_csv writes its index column so.)"""
        if any(_NOT_UTF8.search(name) for name in self._fields):
            raise DataError(f"{label}:1: the header is not valid UTF-8; save the file as UTF-8")
        # a file saved with ; or tab between values (Excel in many locales, a .tsv renamed): its header is one field,
        # so every row lacked the prompt field, "missing field 'prompt' (row has: prompt;answer)" (found by a red team)
        if len(self._fields) == 1 and "," not in self._fields[0]:
            for sep, what in ((";", "semicolon"), ("\t", "tab")):
                if sep in self._fields[0]:
                    raise DataError(f"{label}:1: the header {self._fields[0]!r} is one field holding {sep!r}: the file "
                                    f"looks {what}-separated, and a .csv file is read comma-separated; save it with "
                                    f"commas (e.g. pandas.read_csv(path, sep={sep!r}).to_csv(new_path, index=False))")
        seen = set()
        for name in self._fields:
            if name in seen:
                raise DataError(f"{label}:1: the header names the field {name!r} twice; field names must be distinct")
            seen.add(name)
            # "prompt, answer" names the field ' answer', and a missing 'answer' then showed a list of fields in which
            # the space cannot be seen (found by a red team)
            if name != name.strip() and name.strip():
                ends = [side for side, pad in (("leading", name != name.lstrip()), ("trailing", name != name.rstrip()))
                        if pad]
                raise DataError(f"{label}:1: the header's field {name!r} has {' and '.join(ends)} whitespace, which "
                                "is part of its name in CSV; remove the spaces around the commas in the header")

    def _parse(self, data: bytes) -> dict:
        try:
            record = next(csv.reader(raw.decode("utf-8") for raw in _lines(io.BytesIO(data).read)))
        except UnicodeDecodeError as exc:
            raise Unreadable(f"not valid UTF-8 ({exc.reason})") from None
        if len(record) > len(self._fields):
            raise Unreadable(f"{len(record)} values for the header's {len(self._fields)} fields "
                             f"({', '.join(self._fields)}): quote a value that holds a comma")
        if len(record) < len(self._fields):   # "field 'answer' is null" blamed the field, not the record (red team)
            raise Unreadable(f"{len(record)} value{'s' if len(record) != 1 else ''} for the header's "
                             f"{len(self._fields)} fields ({', '.join(self._fields)}): write every field's value, an "
                             "empty one as nothing between its commas, and quote a value that holds a line break")
        return dict(zip(self._fields, record))


class _ArrowSource:
    """A `datasets.Dataset` (Arrow, memory-mapped from datasets' cache): rows fetched by index."""

    def __init__(self, label: str, dataset):
        self.path, self._ds = label, dataset

    def __len__(self) -> int:
        return len(self._ds)

    def row(self, i: int) -> dict:
        return self._ds[int(i)]

    def line(self, i: int) -> None:
        return None

    def iter_rows(self, block: int = 1000) -> Iterator[tuple[int, object]]:
        i = 0
        for batch in self._ds.iter(batch_size=block):
            names = list(batch)
            for values in zip(*batch.values()):
                yield i, dict(zip(names, values))
                i += 1


class ListSource:
    """Rows given as Python objects (kept as they are: a reward sees the very dict)."""

    def __init__(self, label: str, rows: list):
        self.path, self._rows = label, rows

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, i: int):
        return self._rows[i]

    def line(self, i: int) -> None:
        return None

    def iter_rows(self) -> Iterator[tuple[int, object]]:
        return enumerate(self._rows)


class _JsonArraySource:
    """A .json file holding one JSON array of row objects (as `datasets` reads one): parsed whole at start-up,
    since no element can be found without parsing those before it. An element that is not an object, or holds a
    byte that is not UTF-8, is a bad row, as a JSONL line would be."""

    def __init__(self, label: str, rows: list, lines: list, bad: dict):
        self.path, self._rows, self._lines, self._bad = label, rows, lines, bad

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, i: int) -> dict:
        if i in self._bad:
            raise Unreadable(self._bad[i])
        row = self._rows[i]
        if not isinstance(row, dict):
            raise Unreadable(f"expected a JSON object, got {type(row).__name__}")
        return row

    def line(self, i: int) -> int:
        return self._lines[i]

    def iter_rows(self) -> Iterator[tuple[int, object]]:
        for i in range(len(self._rows)):
            try:
                yield i, self.row(i)
            except Unreadable as exc:
                yield i, exc


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _json_array(p: Path, label: str) -> Optional[_JsonArraySource]:
    """The rows of a .json file that holds one JSON array, or None for JSON Lines (whose first row may be a list on
    its own line). Read as JSON Lines, such a file's rows were all bad but a line that happened to be a whole
    object, which with on_bad_row: skip was all it trained on (found by a red team)."""
    with open(p, "rb") as f:
        head = f.read(1 << 16)
        while head.lstrip(b" \t\r\n") == b"" and len(head) < p.stat().st_size:   # (a file of blank lines first)
            more = f.read(1 << 16)
            if not more:
                break
            head += more
    if head.removeprefix(_BOM).lstrip(b" \t\r\n")[:1] != b"[":
        return None
    text = p.read_bytes().removeprefix(_BOM).decode("utf-8", "surrogateescape")
    decoder, rows, offsets = json.JSONDecoder(), [], []
    begin = _JSON_SPACE.match(text).end()   # the '['
    i = begin + 1
    try:
        i = _JSON_SPACE.match(text, i).end()
        if text[i:i + 1] == "]":
            i += 1
        else:
            while True:
                row, end = decoder.raw_decode(text, i)
                rows.append(row), offsets.append(i)
                i = _JSON_SPACE.match(text, end).end()
                if text[i:i + 1] == "]":
                    i += 1
                    break
                if text[i:i + 1] != ",":
                    raise json.JSONDecodeError("Expecting ',' delimiter or ']'", text, i)
                i = _JSON_SPACE.match(text, i + 1).end()
    except json.JSONDecodeError as exc:
        raise DataError(f"{label}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); a .json file that "
                        "starts with '[' is read as one JSON array of row objects") from None
    except ValueError as exc:  # an integer over Python's digit limit
        raise DataError(f"{label}: an element of its JSON array {_json_value_error(exc)}") from None
    except RecursionError:
        raise DataError(f"{label}: not readable JSON (nested too deeply)") from None
    if text[i:].strip(" \t\r\n"):
        if not _LINE_END_TEXT.search(text, begin, i):   # a list on one line, then more lines: JSON Lines
            return None
        extra = json.JSONDecodeError("", text, _JSON_SPACE.match(text, i).end())   # (for its line and column)
        raise DataError(f"{label}:{extra.lineno}: text follows the end of the JSON array (column {extra.colno}); a "
                        ".json file that starts with '[' is read as one JSON array of row objects")
    lines, line, at = [], 1, 0
    for start in offsets:   # (an element starts at no line end, so no \r\n is cut in two)
        line += text.count("\n", at, start) + text.count("\r", at, start) - text.count("\r\n", at, start)
        lines.append(line)
        at = start
    bad = {}
    for m in _NOT_UTF8.finditer(text):
        k = bisect.bisect_right(offsets, m.start()) - 1
        if k >= 0 and k not in bad:
            bad[k] = "not valid UTF-8"
    return _JsonArraySource(label, rows, lines, bad)


class Subset:
    """Some rows of a source (the training or held-out part of a split), by index, in source order.
    Row numbers in errors stay the source's."""

    def __init__(self, source, indices: np.ndarray, label: Optional[str] = None):
        self.source, self._idx = source, np.asarray(indices, dtype=np.int64)
        self.path = label or source.path

    def __len__(self) -> int:
        return int(self._idx.size)

    def row(self, i: int):
        return self.source.row(int(self._idx[i]))

    def line(self, i: int):
        return self.source.line(int(self._idx[i]))

    def number(self, i: int) -> int:
        return row_number(self.source, int(self._idx[i]))

    def iter_rows(self) -> Iterator[tuple[int, object]]:
        for j, i in enumerate(self._idx.tolist()):
            try:
                yield j, self.source.row(i)
            except Unreadable as exc:
                yield j, exc


def row_number(source, i: int) -> int:
    """1-based row number of source row i, in the file the rows came from."""
    return source.number(i) if isinstance(source, Subset) else i + 1


def open_source(path: str, limit: Optional[int] = None):
    """The rows of a file or hub split, indexed but not read (`limit`: the first N rows only)."""
    if hub.is_hub(path):
        try:
            name = hub.parse(path).name
            if _saved_with_save_to_disk(Path(name)) == "Dataset":  # load_dataset refuses it, blaming the hub
                raise DataError(f"{path}: {name} is a folder written by Dataset.save_to_disk, which holds one split "
                                f"and is loaded as it is: give the folder itself ({name}), without hf: and @SPLIT")
            src = _ArrowSource(path, hub.load(path))
        except ValueError as exc:
            raise DataError(f"{path}: {exc}") from None
    # ~ is the shell's: a recipe's path reaches here as written (found by a red team; model paths were expanded)
    elif _saved_with_save_to_disk(local := Path(path).expanduser()) == "Dataset":
        src = _ArrowSource(path, _load_from_disk(local, path))
    else:
        src = _open_file(local, path, limit)   # (a JSONL or CSV index holds `limit` rows at most)
    return src if limit is None or limit >= len(src) else Subset(src, np.arange(max(0, limit)))


def _open_file(p: Path, path: str, limit: Optional[int]):
    if _saved_with_save_to_disk(p) == "DatasetDict":
        splits = _saved_splits(p)
        raise DataError(f"{path}: is a folder written by DatasetDict.save_to_disk, which holds several splits; give "
                        "one split's folder: " + (", ".join(str(p / s) for s in splits) if splits else str(p / "train")))
    if p.is_dir():
        raise DataError(f"{path}: is a directory; give a .jsonl, .csv or .parquet file (a folder of such files: "
                        f"hf:{path}@train)")
    if not p.is_file():
        raise DataError(f"{path}: file not found")
    suffix = p.suffix.lower()
    try:
        if suffix in (".jsonl", ".json", ".csv"):
            _other_encoding(p, path)
        if suffix == ".json" and (rows := _json_array(p, path)) is not None:
            return rows
        if suffix in (".jsonl", ".json"):
            return _JsonlSource(p, path, limit)
        if suffix == ".csv":
            return _CsvSource(p, path, limit)
    except OSError as exc:  # e.g. no permission to read it
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if suffix != ".parquet":
        raise DataError(f"{path}: unknown file type {suffix!r}; allowed: .jsonl, .csv, .parquet")
    if _parquet_rows(p, path) == 0:  # datasets' own error for it names no cause
        raise DataError(f"{path}: no usable rows (the Parquet table is empty)")
    try:
        return _ArrowSource(path, hub.load_file("parquet", p))
    except ValueError as exc:
        raise DataError(f"{path}: {exc}") from None


# First bytes of text that is not UTF-8, or of no text: such a file was "not valid UTF-8" on every row, which named
# no cause (found by a red team). UTF-32's marks first: UTF-16's LE mark begins UTF-32's LE mark.
_MAGIC = ((b"\xff\xfe\x00\x00", "looks UTF-32 encoded (it starts with a UTF-32 byte order mark): save it as UTF-8"),
          (b"\x00\x00\xfe\xff", "looks UTF-32 encoded (it starts with a UTF-32 byte order mark): save it as UTF-8"),
          (b"\xff\xfe", "looks UTF-16 encoded (it starts with a UTF-16 byte order mark): save it as UTF-8"),
          (b"\xfe\xff", "looks UTF-16 encoded (it starts with a UTF-16 byte order mark): save it as UTF-8"),
          (b"\x1f\x8b", "is gzip-compressed: decompress it (gunzip) and give the file it holds"))


def _other_encoding(p: Path, label: str) -> None:
    """A file-level error for a text file that is UTF-16 or UTF-32, or gzip-compressed (by its first bytes)."""
    with open(p, "rb") as f:
        head = f.read(4)
    for magic, what in _MAGIC:
        if head.startswith(magic):
            raise DataError(f"{label}: {what}")


def _saved_with_save_to_disk(p: Path) -> Optional[str]:
    """'Dataset' or 'DatasetDict' for a folder that `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote (which
    only `datasets.load_from_disk` reads; load_dataset refuses it), else None."""
    try:
        if not p.is_dir():
            return None
        if (p / "dataset_dict.json").is_file():
            return "DatasetDict"
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return "Dataset"
    except OSError:   # (a folder that cannot be looked into: the ordinary errors say so)
        return None
    return None


def _saved_splits(p: Path) -> list:
    """The splits a DatasetDict.save_to_disk folder names (its dataset_dict.json), or [] where it cannot be read."""
    try:
        splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in splits] if isinstance(splits, list) else []


def _load_from_disk(p: Path, label: str):
    """A Dataset.save_to_disk folder as a `datasets.Dataset`, memory-mapped from its Arrow files."""
    try:
        ds = hub._datasets(label).load_from_disk(str(p))
    except ValueError as exc:   # no `datasets` package: hub's message
        raise DataError(f"{label}: {exc}") from None
    except Exception as exc:  # a corrupt or partial folder: datasets and pyarrow raise many types
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        raise DataError(f"{label}: cannot load this Dataset.save_to_disk folder with datasets.load_from_disk: "
                        f"{type(exc).__name__}: {first}") from None
    if not hasattr(ds, "select"):   # a DatasetDict after all
        raise DataError(f"{label}: datasets.load_from_disk gives a {type(ds).__name__}, not one split; give one "
                        "split's folder")
    return ds


def _parquet_rows(path: Path, label: str) -> int:
    """The row count in a Parquet file's footer: a corrupt or truncated file fails here, in one line (datasets
    would also log pyarrow's complaint before raising its own)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        raise DataError(f"{label}: cannot read it as parquet: {type(exc).__name__}: {first}") from None


def read_rows(path: str) -> list[dict]:
    """Every row of a source as a dict (small sources and tests; training reads rows lazily)."""
    src = open_source(path)
    rows = []
    for i, row in src.iter_rows():
        if isinstance(row, Unreadable):
            raise DataError(f"{path}:{src.line(i)}: {row}")
        rows.append(row)
    return rows


