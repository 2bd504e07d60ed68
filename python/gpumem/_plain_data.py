"""Reading the plain data of a pickle (dicts, lists, tuples, strings, bytes, numbers), and
describing such values in messages, for files from outside: see snapshot_file's docstring for why
pickle.Unpickler is not used. Nothing here knows what a snapshot is.
"""
from __future__ import annotations

import math
import pickle
import pickletools
import struct
from typing import Any, Callable, Optional

class Refused(Exception):
    """A pickle that names a global: loading it could call it."""


class BadPickle(Exception):
    """A pickle the reader cannot read as plain data; the message says why."""


class PlainReader:
    """Reads the plain data of a pickle: an iterative stack machine over the opcodes Python's pickle
    writes for dicts, lists, tuples, strings, bytes and numbers at protocols 2 to 5.

    It never recurses, so no depth of nesting raises RecursionError; each opcode makes at most one
    object, no larger than the bytes it reads, so memory is bounded by the file's size.
    """

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.at = 0  # where the opcode being read starts, for messages
        self.stack: list = []
        self.marks: list[list] = []  # the stacks that MARKs set aside
        self.memo: dict[int, Any] = {}

    def load(self) -> Any:
        data, opcodes = self.data, OPCODES
        while self.pos < len(data):
            self.at = self.pos
            self.pos += 1
            opcode = opcodes.get(data[self.at])
            if opcode is None:
                raise BadPickle(f"it holds {_opcode_name(data[self.at])}, which plain data never needs")
            if opcode(self):
                return self.stop()
        raise BadPickle("it ends before its STOP opcode (the file is cut short)")

    def stop(self) -> Any:
        if len(self.stack) != 1 or self.marks:
            raise BadPickle(f"it ends with {len(self.stack)} values and {len(self.marks)} marks on its stack, "
                             "not one value")
        if self.pos != len(self.data):
            raise BadPickle(f"{len(self.data) - self.pos} bytes follow its STOP opcode")
        return self.stack.pop()

    def take(self, count: int) -> bytes:
        start = self.pos
        self.pos += count
        if self.pos > len(self.data):
            raise BadPickle("it ends inside an opcode (the file is cut short)")
        return self.data[start:self.pos]

    def unpack(self, layout: struct.Struct) -> int:
        # struct.error past the end: _unpickle reports it as a file cut short
        value = layout.unpack_from(self.data, self.pos)[0]
        self.pos += layout.size
        return value

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise BadPickle("it ends inside an opcode (the file is cut short)")
        text, self.pos = self.data[self.pos:end].decode("utf-8", "replace"), end + 1
        return text

    def pop_mark(self) -> list:
        if not self.marks:
            raise BadPickle("it takes the values above a MARK it never set")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def top(self, kind: type) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise BadPickle(f"it adds to {describe(target)}, not to a {kind.__name__}")
        return target


def _opcode_name(code: int) -> str:
    known = _OPCODE_NAMES.get(code)
    return f"the opcode {known}" if known else f"the byte {code:#04x}, which is no opcode"


_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_U1, _U2, _U4, _U8 = (struct.Struct(layout) for layout in ("<B", "<H", "<I", "<Q"))
_I4, _DOUBLE = struct.Struct("<i"), struct.Struct(">d")


def _key(value: Any) -> Any:
    # Hashing a tuple walks all its parts, which shared references can make 2^40 of; an integer's
    # hash is worked out anew for each dict it keys. A snapshot's keys are strings and small numbers.
    kind = type(value)
    if kind in (str, bytes, float, bool, type(None)) or (kind is int and value.bit_length() <= 64):
        return value
    raise BadPickle(f"it has a dict key that is {describe(value)}; a snapshot's keys are strings and numbers")


# Each opcode reads its arguments and changes the stack; STOP alone returns True.

def _proto(reader: PlainReader) -> None:
    version = reader.unpack(_U1)
    if not 2 <= version <= 5:
        raise BadPickle(f"it names protocol {version}; gpumem reads protocols 2 to 5")


def _frame(reader: PlainReader) -> None:
    # A frame only tells a reader how much to buffer; this one holds the whole file already.
    if reader.unpack(_U8) > len(reader.data) - reader.pos:
        raise BadPickle("it has a frame longer than the rest of the file")


def _constant(value: Any) -> Callable[[PlainReader], None]:
    return lambda reader: reader.stack.append(value)


def _new(kind: type) -> Callable[[PlainReader], None]:
    return lambda reader: reader.stack.append(kind())


def _integer(layout: struct.Struct) -> Callable[[PlainReader], None]:
    return lambda reader: reader.stack.append(reader.unpack(layout))


def _long(layout: struct.Struct) -> Callable[[PlainReader], None]:
    def read(reader: PlainReader) -> None:
        count = reader.unpack(layout)
        if count < 0:
            raise BadPickle(f"it gives an integer a length of {count} bytes")
        reader.stack.append(int.from_bytes(reader.take(count), "little", signed=True))
    return read


def _float(reader: PlainReader) -> None:
    reader.stack.append(reader.unpack(_DOUBLE))


def _text(layout: struct.Struct) -> Callable[[PlainReader], None]:
    # "surrogatepass", as pickle itself decodes: Python writes lone surrogates that way.
    return lambda reader: reader.stack.append(str(reader.take(reader.unpack(layout)), "utf-8", "surrogatepass"))


def _binary(layout: struct.Struct) -> Callable[[PlainReader], None]:
    return lambda reader: reader.stack.append(reader.take(reader.unpack(layout)))


def _mark(reader: PlainReader) -> None:
    reader.marks.append(reader.stack)
    reader.stack = []


def _pop(reader: PlainReader) -> None:
    # As pickle pops: the value on top, or, with none above the last MARK, that MARK.
    if reader.stack or not reader.marks:
        reader.stack.pop()
    else:
        reader.pop_mark()


def _pop_mark(reader: PlainReader) -> None:
    reader.pop_mark()


def _append(reader: PlainReader) -> None:
    value = reader.stack.pop()
    reader.top(list).append(value)


def _appends(reader: PlainReader) -> None:
    items = reader.pop_mark()
    reader.top(list).extend(items)


def _setitem(reader: PlainReader) -> None:
    value, key = reader.stack.pop(), reader.stack.pop()
    reader.top(dict)[_key(key)] = value


def _setitems(reader: PlainReader) -> None:
    items = reader.pop_mark()
    if len(items) % 2:
        raise BadPickle(f"it gives SETITEMS {len(items)} values, an odd number: keys and values come in pairs")
    target = reader.top(dict)
    for key, value in zip(items[::2], items[1::2]):
        target[_key(key)] = value


def _tuple(reader: PlainReader) -> None:
    # pop_mark first, on its own line: it replaces reader.stack, and `reader.stack.append(...)` would
    # look up append on the stack it set aside.
    items = reader.pop_mark()
    reader.stack.append(tuple(items))


def _tuple_of(count: int) -> Callable[[PlainReader], None]:
    def make(reader: PlainReader) -> None:
        if len(reader.stack) < count:
            raise IndexError
        items = tuple(reader.stack[-count:])
        del reader.stack[-count:]
        reader.stack.append(items)
    return make


def _put(layout: struct.Struct) -> Callable[[PlainReader], None]:
    def put(reader: PlainReader) -> None:
        reader.memo[reader.unpack(layout)] = reader.stack[-1]
    return put


def _memoize(reader: PlainReader) -> None:
    reader.memo[len(reader.memo)] = reader.stack[-1]


def _get(layout: struct.Struct) -> Callable[[PlainReader], None]:
    def get(reader: PlainReader) -> None:
        index = reader.unpack(layout)
        try:
            reader.stack.append(reader.memo[index])
        except KeyError:
            raise BadPickle(f"it refers to memo entry {index}, which it never stored") from None
    return get


def _global(reader: PlainReader) -> None:
    # GLOBAL and INST name their global in two lines of text.
    module = reader.line()
    raise Refused(f"{cut(module)}.{cut(reader.line())}")


def _stack_global(reader: PlainReader) -> None:
    name, module = reader.stack.pop(), reader.stack.pop()
    if isinstance(module, str) and isinstance(name, str):
        raise Refused(f"{cut(module)}.{cut(name)}")
    raise BadPickle(f"it names a global by {describe(module)} and {describe(name)}, not by two strings")


def _stop(reader: PlainReader) -> bool:
    return True


OPCODES: dict[int, Callable[[PlainReader], Optional[bool]]] = {
    opcode[0]: read for opcode, read in [
        (pickle.PROTO, _proto), (pickle.FRAME, _frame), (pickle.STOP, _stop),
        (pickle.NONE, _constant(None)), (pickle.NEWTRUE, _constant(True)), (pickle.NEWFALSE, _constant(False)),
        (pickle.BININT, _integer(_I4)), (pickle.BININT1, _integer(_U1)), (pickle.BININT2, _integer(_U2)),
        (pickle.LONG1, _long(_U1)), (pickle.LONG4, _long(_I4)), (pickle.BINFLOAT, _float),
        (pickle.SHORT_BINUNICODE, _text(_U1)), (pickle.BINUNICODE, _text(_U4)), (pickle.BINUNICODE8, _text(_U8)),
        (pickle.SHORT_BINBYTES, _binary(_U1)), (pickle.BINBYTES, _binary(_U4)), (pickle.BINBYTES8, _binary(_U8)),
        (pickle.EMPTY_DICT, _new(dict)), (pickle.EMPTY_LIST, _new(list)), (pickle.EMPTY_TUPLE, _constant(())),
        (pickle.MARK, _mark), (pickle.POP, _pop), (pickle.POP_MARK, _pop_mark),
        (pickle.APPEND, _append), (pickle.APPENDS, _appends),
        (pickle.SETITEM, _setitem), (pickle.SETITEMS, _setitems),
        (pickle.TUPLE, _tuple), (pickle.TUPLE1, _tuple_of(1)), (pickle.TUPLE2, _tuple_of(2)),
        (pickle.TUPLE3, _tuple_of(3)),
        (pickle.BINPUT, _put(_U1)), (pickle.LONG_BINPUT, _put(_U4)), (pickle.MEMOIZE, _memoize),
        (pickle.BINGET, _get(_U1)), (pickle.LONG_BINGET, _get(_U4)),
        (pickle.GLOBAL, _global), (pickle.INST, _global), (pickle.STACK_GLOBAL, _stack_global),
    ]
}


# ---- describing values from the file ------------------------------------------------------------

_SHOWN = 40  # the most characters of a value from the file that a message shows
_TEN_TO_SHOWN = 10 ** _SHOWN
_LOG10_2 = math.log10(2)
_EXACT_DIGITS_BITS = 1 << 20  # past this, the power of ten that makes a digit count exact costs too much


def describe(value: Any) -> str:
    """A value from the file for a message: one short line, made without walking or hashing it."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return describe_integer(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= _SHOWN else f"{value[:_SHOWN]!r}… ({len(value)} characters)"
    if isinstance(value, dict):
        return _count("a dict of", len(value), "key") if value else "an empty dict"
    if isinstance(value, (bytes, bytearray)):
        return _count("a byte string of", len(value), "byte")
    kind = type(value).__name__
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _count(what: str, count: int, unit: str) -> str:
    return f"{what} {count} {unit}{'' if count == 1 else 's'}"


def describe_integer(value: int) -> str:
    # str() refuses integers past 4300 digits, and its work grows with the square of their length.
    if -_TEN_TO_SHOWN < value < _TEN_TO_SHOWN:
        return str(value)
    magnitude = abs(value)
    digits = int(magnitude.bit_length() * _LOG10_2) + 1  # the count of digits, or one more
    if magnitude.bit_length() > _EXACT_DIGITS_BITS:
        return f"an integer of about {digits} digits"
    return f"an integer of {digits if magnitude >= 10 ** (digits - 1) else digits - 1} digits"


def cut(text: str) -> str:
    """A string for a message, without quotes: at most _SHOWN characters, on one line."""
    shown = text[:_SHOWN] if text[:_SHOWN].isprintable() else repr(text[:_SHOWN])[1:-1]
    return shown if len(text) <= _SHOWN else f"{shown}… ({len(text)} characters)"
