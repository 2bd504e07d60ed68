"""Reading the plain data of a pickle (dicts, lists, tuples, strings, bytes, numbers), and
describing such values in messages, for files from outside: see snapshot_file's docstring for why
pickle.Unpickler is not used. Nothing here knows what a snapshot is.

Whatever the input, the reader returns its value or raises BadPickle: Refused, a BadPickle, for a
pickle that names a global, and TooLarge, one too, for one whose values would take too much memory
(Note [memory]). KeyboardInterrupt alone goes through as it comes.
"""
from __future__ import annotations

import math
import pickle
import pickletools
import struct
from typing import Any, Callable, Optional

from gpumem.settings.echo import SHOWN_LENGTH, shown

class BadPickle(ValueError):
    """A pickle the reader cannot read as plain data; the message says why."""


class Refused(BadPickle):
    """A pickle that names a global: loading it could call it. The message is the global's name."""


class TooLarge(BadPickle):
    """A pickle whose values would take more memory than the reader allows (Note [memory]), or than
    there is."""


MEMORY_PER_BYTE = 48  # the memory the values may take, per byte of the pickle: see Note [memory]
MEMORY_SLACK = 1 << 20
CHUNK = 1 << 20  # the reader reads its input this much at a time, or what one opcode needs
_LINE_MOST = 4096  # GLOBAL's and INST's lines, read only to name the global they refuse

# Note [memory]
#   A one-byte opcode can make a 64-byte dict, so a pickle's values can take some 80 times its size.
#   The reader counts what each value it makes takes (CPython's sizes on a 64-bit machine, as the
#   opcode costs below give them; text at 4 bytes a character, its widest) and refuses a pickle once
#   the count passes MEMORY_PER_BYTE times its size, plus MEMORY_SLACK. What Python's pickler writes
#   stays under it: its densest output, a list of empty dicts at protocol 4 (two bytes and 88
#   counted bytes each), counts 44 a byte. The count never goes down: a value dropped (POP) still
#   counts, which a pickle from the pickler does only for recursive tuples.


def memory_budget(size: int) -> int:
    """The most memory, as the reader counts it, that the values of a pickle of `size` bytes take."""
    return MEMORY_PER_BYTE * size + MEMORY_SLACK


class PlainReader:
    """Reads the plain data of a pickle: an iterative stack machine over the opcodes Python's pickle
    writes for dicts, lists, tuples, strings, bytes and numbers at protocols 2 to 5.

    The input is `data`, then what `read(count)` returns (up to `count` bytes, fewer at the end),
    `size` bytes in all (len(data) without `read`). It is read as the opcodes need it, CHUNK at a
    time, so a pickle that goes wrong early is refused before the rest is read, and no more than
    `size` bytes are read. The reader never recurses, so no depth of nesting raises RecursionError,
    and it bounds the memory its values take by the input's size (Note [memory]).

    Invariants: buffer[pos:] is the input from offset start + pos on, not yet read as opcodes; memo
    holds the memo's entries 0 .. len(memo) - 1, and sparse the others, each above len(memo).
    """

    def __init__(self, data: bytes, read: Optional[Callable[[int], bytes]] = None, size: Optional[int] = None):
        self.buffer = data
        self.read = read
        self.size = len(data) if size is None else size
        self.start = 0  # the input's offset of buffer[0]
        self.pos = 0
        self.at = 0  # the input's offset where the opcode being read starts, for messages
        self.stack: list = []
        self.marks: list[list] = []  # the stacks that MARKs set aside
        self.memo: list = []
        self.sparse: dict[int, Any] = {}  # memo entries put past the end of memo
        self.spent = 0  # the memory the values take, as Note [memory] counts it
        self.memory = memory_budget(self.size)

    def load(self) -> Any:
        """The pickle's value; BadPickle if it is not plain data."""
        try:
            return self._run()
        except BadPickle:
            raise
        # Only the stack's pops and [-1] raise IndexError, only decoding text UnicodeDecodeError.
        except IndexError:
            raise BadPickle("it takes a value from an empty stack") from None
        except UnicodeDecodeError as error:
            raise BadPickle(f"it holds text that is not UTF-8 ({error.reason} at byte {error.start} of it)") from None
        except MemoryError:
            raise TooLarge("there is not the memory to hold its values (MemoryError)") from None

    def _run(self) -> Any:
        opcodes, memory = OPCODES, self.memory
        while True:
            pos = self.pos
            if pos == len(self.buffer):
                if self.start + pos >= self.size:
                    raise BadPickle("it ends before its STOP opcode (the file is cut short)")
                self.need(1)
                pos = self.pos
            self.at = self.start + pos
            code = self.buffer[pos]
            self.pos = pos + 1
            entry = opcodes.get(code)
            if entry is None:
                raise BadPickle(f"it holds {_opcode_name(code)}, which plain data never needs")
            read, cost = entry
            self.spent += cost
            if self.spent > memory:
                raise self.too_large()
            if read(self):
                return self.stop()

    def stop(self) -> Any:
        if len(self.stack) != 1 or self.marks:
            raise BadPickle(f"it ends with {len(self.stack)} values and {len(self.marks)} marks on its stack, "
                             "not one value")
        after = self.size - (self.start + self.pos)
        if after:
            raise BadPickle(f"{after} bytes follow its STOP opcode")
        return self.stack.pop()

    def charge(self, amount: int) -> None:
        """Counts `amount` bytes more of memory, before the value that takes them is made."""
        self.spent += amount
        if self.spent > self.memory:
            raise self.too_large()

    def too_large(self) -> TooLarge:
        return TooLarge(f"its values would take more than {self.memory} bytes of memory ({MEMORY_PER_BYTE} for "
                        f"each of its {self.size} bytes): more than a pickle of plain data of its size needs")

    def need(self, count: int) -> None:
        """Makes the next `count` bytes of the input readable from buffer[pos:]."""
        have = len(self.buffer) - self.pos
        if count <= have:
            return
        left = self.size - self.start - len(self.buffer)  # not read yet
        if self.read is None or count - have > left:
            raise BadPickle("it ends inside an opcode (the file is cut short)")
        more = self.read(min(max(count - have, CHUNK), left))
        self.buffer, self.start, self.pos = self.buffer[self.pos:] + more, self.start + self.pos, 0
        if len(self.buffer) < count:  # the file shrank as it was read
            raise BadPickle("it ends inside an opcode (the file is cut short)")

    def take(self, count: int) -> bytes:
        self.need(count)
        start = self.pos
        self.pos += count
        return bytes(self.buffer[start:self.pos])

    def unpack(self, layout: struct.Struct) -> int:
        self.need(layout.size)
        value = layout.unpack_from(self.buffer, self.pos)[0]
        self.pos += layout.size
        return value

    def line(self) -> str:
        self.need(min(_LINE_MOST, self.size - self.start - self.pos))
        end = self.buffer.find(b"\n", self.pos, self.pos + _LINE_MOST)
        if end < 0:
            raise BadPickle(f"it names a global by a line that does not end within {_LINE_MOST} bytes")
        text, self.pos = self.buffer[self.pos:end].decode("utf-8", "replace"), end + 1
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

    def put(self, index: int, value: Any) -> None:
        if index < len(self.memo):
            self.memo[index] = value
            return
        if index > len(self.memo):
            self.charge(_SPARSE_ENTRY)
            self.sparse[index] = value
            return
        self.memo.append(value)
        while len(self.memo) in self.sparse:  # entries put ahead that are next now
            self.memo.append(self.sparse.pop(len(self.memo)))

    def get(self, index: int) -> Any:
        if index < len(self.memo):
            return self.memo[index]
        if index in self.sparse:
            return self.sparse[index]
        raise BadPickle(f"it refers to memo entry {index}, which it never stored")


def loads(data: bytes) -> Any:
    """The plain data of the pickle `data`; BadPickle if it is not one."""
    return PlainReader(data).load()


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


# Each opcode reads its arguments and changes the stack; STOP alone returns True. What the values it
# makes take (Note [memory]) is its cost in OPCODES, counted before it runs, and for those whose
# arguments say a length or a count, what it counts itself before it makes the value.

_POINTER = 8  # a slot in the stack, a list, a tuple or the memo
_CONTAINER = 64  # an empty dict or list, as CPython's allocator rounds it
_SPARSE_ENTRY = 100  # a memo entry put ahead: a dict entry and its key
_DICT_ENTRY = 48
_TEXT_HEADER, _BYTES_HEADER, _INT_HEADER = 56, 40, 32


def _proto(reader: PlainReader) -> None:
    version = reader.unpack(_U1)
    if not 2 <= version <= 5:
        raise BadPickle(f"it names protocol {version}; gpumem reads protocols 2 to 5")


def _frame(reader: PlainReader) -> None:
    # A frame only tells a reader how much to buffer; this one reads what each opcode needs.
    if reader.unpack(_U8) > reader.size - (reader.start + reader.pos):
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
        reader.need(count)
        reader.charge(2 * count)  # CPython keeps 30 bits in each 4 bytes
        reader.stack.append(int.from_bytes(reader.take(count), "little", signed=True))
    return read


def _float(reader: PlainReader) -> None:
    reader.stack.append(reader.unpack(_DOUBLE))


def _text(layout: struct.Struct) -> Callable[[PlainReader], None]:
    def read(reader: PlainReader) -> None:
        count = reader.unpack(layout)
        reader.need(count)
        reader.charge(4 * count)  # at most a character a byte, each at most 4 bytes wide
        # "surrogatepass", as pickle itself decodes: Python writes lone surrogates that way.
        reader.stack.append(str(reader.take(count), "utf-8", "surrogatepass"))
    return read


def _binary(layout: struct.Struct) -> Callable[[PlainReader], None]:
    def read(reader: PlainReader) -> None:
        count = reader.unpack(layout)
        reader.need(count)
        reader.charge(count)
        reader.stack.append(reader.take(count))
    return read


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
    reader.charge(_POINTER * len(items))
    reader.top(list).extend(items)


def _setitem(reader: PlainReader) -> None:
    value, key = reader.stack.pop(), reader.stack.pop()
    reader.top(dict)[_key(key)] = value


def _setitems(reader: PlainReader) -> None:
    items = reader.pop_mark()
    if len(items) % 2:
        raise BadPickle(f"it gives SETITEMS {len(items)} values, an odd number: keys and values come in pairs")
    reader.charge(_DICT_ENTRY * (len(items) // 2))
    target = reader.top(dict)
    for key, value in zip(items[::2], items[1::2]):
        target[_key(key)] = value


def _tuple(reader: PlainReader) -> None:
    # pop_mark first, on its own line: it replaces reader.stack, and `reader.stack.append(...)` would
    # look up append on the stack it set aside.
    items = reader.pop_mark()
    reader.charge(_POINTER * len(items))
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
        index = reader.unpack(layout)
        reader.put(index, reader.stack[-1])
    return put


def _memoize(reader: PlainReader) -> None:
    # The next index is the count of entries, as pickle numbers them.
    reader.put(len(reader.memo) + len(reader.sparse), reader.stack[-1])


def _get(layout: struct.Struct) -> Callable[[PlainReader], None]:
    return lambda reader: reader.stack.append(reader.get(reader.unpack(layout)))


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


_P = _POINTER
# opcode -> (what reads it, the memory the value it makes takes, as Note [memory] counts it)
OPCODES: dict[int, tuple[Callable[[PlainReader], Optional[bool]], int]] = {
    opcode[0]: (read, cost) for opcode, read, cost in [
        (pickle.PROTO, _proto, 0), (pickle.FRAME, _frame, 0), (pickle.STOP, _stop, 0),
        (pickle.NONE, _constant(None), _P), (pickle.NEWTRUE, _constant(True), _P),
        (pickle.NEWFALSE, _constant(False), _P),
        (pickle.BININT, _integer(_I4), _P + _INT_HEADER), (pickle.BININT1, _integer(_U1), _P),  # 0..255: cached
        (pickle.BININT2, _integer(_U2), _P + _INT_HEADER),
        (pickle.LONG1, _long(_U1), _P + _INT_HEADER), (pickle.LONG4, _long(_I4), _P + _INT_HEADER),
        (pickle.BINFLOAT, _float, _P + 24),
        (pickle.SHORT_BINUNICODE, _text(_U1), _P + _TEXT_HEADER), (pickle.BINUNICODE, _text(_U4), _P + _TEXT_HEADER),
        (pickle.BINUNICODE8, _text(_U8), _P + _TEXT_HEADER),
        (pickle.SHORT_BINBYTES, _binary(_U1), _P + _BYTES_HEADER), (pickle.BINBYTES, _binary(_U4), _P + _BYTES_HEADER),
        (pickle.BINBYTES8, _binary(_U8), _P + _BYTES_HEADER),
        (pickle.EMPTY_DICT, _new(dict), _P + _CONTAINER), (pickle.EMPTY_LIST, _new(list), _P + _CONTAINER),
        (pickle.EMPTY_TUPLE, _constant(()), _P),
        (pickle.MARK, _mark, _P + _CONTAINER), (pickle.POP, _pop, 0), (pickle.POP_MARK, _pop_mark, 0),
        (pickle.APPEND, _append, _P), (pickle.APPENDS, _appends, 0),
        (pickle.SETITEM, _setitem, _DICT_ENTRY), (pickle.SETITEMS, _setitems, 0),
        (pickle.TUPLE, _tuple, 40), (pickle.TUPLE1, _tuple_of(1), 48), (pickle.TUPLE2, _tuple_of(2), 56),
        (pickle.TUPLE3, _tuple_of(3), 64),
        (pickle.BINPUT, _put(_U1), _P), (pickle.LONG_BINPUT, _put(_U4), _P), (pickle.MEMOIZE, _memoize, _P),
        (pickle.BINGET, _get(_U1), _P), (pickle.LONG_BINGET, _get(_U4), _P),
        (pickle.GLOBAL, _global, 0), (pickle.INST, _global, 0), (pickle.STACK_GLOBAL, _stack_global, 0),
    ]
}


# ---- describing values from the file ------------------------------------------------------------

_TEN_TO_SHOWN = 10 ** SHOWN_LENGTH  # an integer of more digits is described by its digit count
_LOG10_2 = math.log10(2)
_EXACT_DIGITS_BITS = 1 << 20  # past this, the power of ten that makes a digit count exact costs too much


def describe(value: Any) -> str:
    """A value from the file for a message: one short line, made without walking or hashing it."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return describe_integer(value)
    if isinstance(value, str):
        return shown(value)
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
    """A string for a message, without quotes, as `shown` cuts it: on one line, not too long."""
    return shown(text, quote="")
