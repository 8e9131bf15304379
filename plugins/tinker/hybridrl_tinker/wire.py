"""A small proto3 codec for the binary messages of the Tinker training API, without the protobuf package.

The ``tinker`` SDK (0.38) sends ``forward_backward`` as an ``application/x-protobuf`` body holding the
message ``tinker_public.ForwardBackwardRequest``, and reads ``ForwardBackwardOutput`` and ``SampleResponse``
in the same encoding. A server needs three things of that schema: decode the request
(:func:`read_forward_backward`) and encode the two results (:func:`forward_backward_output`,
:func:`sample_response`). Doing it here with the standard library and torch keeps ``protobuf`` and ``tinker``
out of the server's dependencies. Field numbers are those of the SDK's descriptor
(``tinker/proto/tinker_public_pb2.py``); tests/test_wire.py checks this codec against the SDK's own encoder
and decoders.

The request body is untrusted: anything malformed raises :class:`WireError`, unknown fields are skipped as
proto3 says, and tensor shapes are charged to a budget of elements before anything is allocated. Raw arrays
on this wire are little-endian; the module refuses to load on a big-endian host rather than misread them.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

if sys.byteorder != "little":
    raise ImportError("hybridrl_tinker.wire reads and writes arrays in host order: it needs a little-endian host")

_MASK64 = (1 << 64) - 1
# DType enum -> (name, torch dtype on the wire, torch dtype decoded to: float32 or int64, as the SDK widens).
_DTYPES = {
    1: ("float32", torch.float32, torch.float32),
    2: ("int64", torch.int64, torch.int64),
    3: ("int32", torch.int32, torch.int64),
    4: ("bfloat16", torch.bfloat16, torch.float32),
}
_STOP_REASONS = {"stop": 0, "length": 1}
# The reductions the SDK's chunked_fwdbwd_helpers know how to combine across chunks of a request.
_REDUCTIONS = {"mean", "sum", "min", "max", "slack", "hash2", "unique"}


class WireError(ValueError):
    """A request body that is not a well-formed message of the schema; the text says what is wrong."""


@dataclass
class Datum:
    """One datum of a forward_backward request."""

    tokens: list[int]  # the model input: its encoded_text chunks concatenated
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, dense, as torch.float32 or torch.int64


@dataclass
class ForwardBackwardRequest:
    """A decoded ``tinker_public.ForwardBackwardRequest``."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float | str]  # loss_fn_config_v2 when present, else the legacy loss_fn_config
    forward_only: bool


class _Budget:
    """The tensor elements a request may still decode to, charged before each allocation."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, shape: list[int], where: str) -> None:
        """Charge a shape, a 0 counting as 1 so that a shape like [2**62, 2**62, 0] is refused too."""
        if any(dim < 0 for dim in shape):
            raise WireError(f"{where} has a negative dimension in shape {shape}")
        count = math.prod(max(dim, 1) for dim in shape)
        if count > self.left:
            raise WireError(f"{where}: shape {shape} asks for {count} elements, over the {self.left} left")
        self.left -= count


# ---- decoding ---------------------------------------------------------------------------------------


def _varint(buf: memoryview, pos: int, where: str) -> tuple[int, int]:
    """The unsigned varint at ``pos`` (kept to 64 bits) and the position after it."""
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(buf):
            raise WireError(f"{where}: truncated message (a varint runs past the end)")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
    raise WireError(f"{where}: malformed varint (longer than 10 bytes)")


def _fields(buf: memoryview, where: str) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field: an int for a varint, the raw bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError(f"{where}: malformed message (field number 0)")
        if wire_type == 0:
            value, pos = _varint(buf, pos, where)
            yield number, wire_type, value
            continue
        if wire_type == 2:
            size, pos = _varint(buf, pos, where)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
        else:
            raise WireError(f"{where}: malformed message (wire type {wire_type} on field {number})")
        if pos + size > len(buf):
            raise WireError(f"{where}: truncated message (field {number} needs {size} bytes, {len(buf) - pos} left)")
        yield number, wire_type, buf[pos : pos + size]
        pos += size


def _signed(value: int, bits: int) -> int:
    """A varint read as a two's-complement int32 or int64."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _text(raw: memoryview, where: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"{where}: a string field is not valid UTF-8") from exc


def _entry(raw: memoryview, wire_type: int, where: str) -> tuple[str, int | memoryview | None]:
    """The key and value of a map entry; the value is None when absent (or of another wire type)."""
    key, value = "", None
    for number, wt, field in _fields(raw, where):
        if (number, wt) == (1, 2):
            key = _text(field, where)
        elif (number, wt) == (2, wire_type):
            value = field
    return key, value


def _array(raw: memoryview, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    """``count`` values of ``dtype`` from raw bytes, after checking that the byte length matches."""
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise WireError(f"{what} ({expected} expected)")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype)


def _tensor(buf: memoryview, where: str, budget: _Budget) -> torch.Tensor:
    """A ``Tensor`` message as a dense torch tensor of its shape (float32 or int64)."""
    dense, sparse, code, shape = memoryview(b""), None, 0, []
    for number, wt, value in _fields(buf, where):
        if (number, wt) == (1, 2):
            dense, sparse = value, None
        elif (number, wt) == (2, 2):
            sparse = value
        elif (number, wt) == (3, 0):
            code = value
        elif (number, wt) == (4, 0):
            shape.append(_signed(value, 64))
        elif (number, wt) == (4, 2):  # packed, as proto3 writes it
            pos = 0
            while pos < len(value):
                dim, pos = _varint(value, pos, where)
                shape.append(_signed(dim, 64))
    if code not in _DTYPES:
        raise WireError(f"{where} has unknown dtype {code} (known: 1 float32, 2 int64, 3 int32, 4 bfloat16)")
    name, dtype, widened = _DTYPES[code]
    if not shape and sparse is None:  # no shape on the wire: a 1-D tensor of whatever the data holds
        shape = [len(dense) // dtype.itemsize]
    budget.take(shape, where)
    count = math.prod(shape)
    if sparse is not None:
        tensor = _sparse(sparse, shape, dtype, where)
    else:
        what = f"{where} has {len(dense)} bytes of data for shape {shape} {name}"
        tensor = _array(dense, dtype, count, what).reshape(shape)
    return tensor.to(widened)


def _sparse(buf: memoryview, shape: list[int], dtype: torch.dtype, where: str) -> torch.Tensor:
    """A ``SparseCsr`` message made dense; entries it does not list are 0 (the SDK's default pad value)."""
    parts = {1: memoryview(b""), 2: memoryview(b""), 3: memoryview(b"")}
    for number, wt, value in _fields(buf, where):
        if number in parts and wt == 2:
            parts[number] = value
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse CSR tensor must be 2-D, got shape {shape}")
    rows, cols = shape
    crow = _array(parts[2], torch.int64, rows + 1, f"{where}: {len(parts[2])} bytes of crow_indices for {rows} rows")
    counts = crow.diff()
    if int(crow[0]) != 0 or bool((counts < 0).any()):
        raise WireError(f"{where}: crow_indices must start at 0 and never decrease")
    nnz = int(crow[-1])
    col = _array(parts[3], torch.int64, nnz, f"{where}: {len(parts[3])} bytes of col_indices for {nnz} entries")
    values = _array(parts[1], dtype, nnz, f"{where}: {len(parts[1])} bytes of values for {nnz} entries")
    if nnz and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(f"{where}: a column index is outside [0, {cols})")
    dense = torch.zeros(shape, dtype=dtype)
    dense[torch.repeat_interleave(torch.arange(rows), counts), col] = values
    return dense


def _chunk_tokens(buf: memoryview, where: str) -> list[int]:
    """The tokens of a ``Chunk``; only encoded_text chunks are served."""
    kind, raw = None, memoryview(b"")
    for number, wt, value in _fields(buf, where):
        if wt == 2 and number in (1, 2, 3):  # the oneof: the last one set wins
            kind = number
        if (number, wt) == (1, 2):
            for inner, inner_wt, tokens in _fields(value, where):
                if (inner, inner_wt) == (1, 2):
                    raw = tokens
    if kind in (2, 3):
        name = "an image" if kind == 2 else "a dmel (audio)"
        raise WireError(f"{where} is {name} chunk: image and audio inputs are not served: send encoded_text chunks")
    if kind is None:
        raise WireError(f"{where} holds no encoded_text (an unknown chunk type?): send encoded_text chunks")
    if len(raw) % 4:
        raise WireError(f"{where}: {len(raw)} bytes of tokens is not a whole number of int32")
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def _datum(buf: memoryview, where: str, budget: _Budget) -> Datum:
    """A ``Datum`` message; provenance spans (fields 3 and 4) are skipped."""
    datum, chunks = Datum([], {}), 0
    for number, wt, value in _fields(buf, where):
        if (number, wt) == (1, 2):
            datum.tokens += _chunk_tokens(value, f"{where}: chunk {chunks}")
            chunks += 1
        elif (number, wt) == (2, 2):
            name, tensor = _entry(value, 2, where)
            tensor_where = f"{where}: tensor {name!r}"
            datum.inputs[name] = _tensor(tensor if tensor is not None else memoryview(b""), tensor_where, budget)
    return datum


def _config_value(raw: memoryview | None, where: str) -> float | str:
    """A ``LossConfigValue``: its number or its text, whichever was set last."""
    value = None
    for number, wt, field in _fields(raw if raw is not None else memoryview(b""), where):
        if (number, wt) == (1, 1):
            value = struct.unpack("<d", field)[0]
        elif (number, wt) == (2, 2):
            value = _text(field, where)
    if value is None:
        raise WireError(f"{where} has neither a number nor a text")
    return value


def read_forward_backward(body: bytes, max_elements: int = 1 << 28) -> ForwardBackwardRequest:
    """Decode a forward_backward request body; ``max_elements`` bounds the tensor elements of the whole request."""
    request = ForwardBackwardRequest("", 0, [], "", {}, False)
    legacy: dict[str, float | str] = {}
    budget = _Budget(max_elements)
    for number, wt, value in _fields(memoryview(body), "request"):
        if (number, wt) == (1, 2):
            request.model_id = _text(value, "model_id")
        elif (number, wt) == (2, 0):
            request.seq_id = _signed(value, 32)
        elif (number, wt) == (3, 2):
            request.data.append(_datum(value, f"datum {len(request.data)}", budget))
        elif (number, wt) == (4, 2):
            request.loss_fn = _text(value, "loss_fn")
        elif (number, wt) == (5, 2):
            key, number_value = _entry(value, 1, "loss_fn_config")
            legacy[key] = struct.unpack("<d", number_value)[0] if number_value is not None else 0.0
        elif (number, wt) == (6, 0):
            request.forward_only = value != 0
        elif (number, wt) == (7, 2):
            key, config_value = _entry(value, 2, "loss_fn_config_v2")
            request.config[key] = _config_value(config_value, f"loss_fn_config_v2 {key!r}")
    if not request.config:
        request.config = legacy
    return request


# ---- encoding ---------------------------------------------------------------------------------------


def _varint_bytes(value: int) -> bytes:
    """A varint; negative values as 10-byte two's complement, as proto3 writes int32 and int64."""
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint_bytes(number << 3) + _varint_bytes(value)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint_bytes(number << 3 | 2) + _varint_bytes(len(payload)) + payload


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    """The tensor's values, flattened, as raw little-endian bytes of ``dtype``."""
    flat = tensor.detach().reshape(-1)
    out = bytearray(flat.numel() * dtype.itemsize)
    if out:
        torch.frombuffer(out, dtype=dtype).copy_(flat)
    return bytes(out)


def _batched_tensor(name: str, tensors: list[torch.Tensor]) -> bytes:
    """One field of every datum as a ``BatchedTensor``: the arrays concatenated, with byte offsets."""
    floating = tensors[0].is_floating_point()
    dtype, code = (torch.float32, 1) if floating else (torch.int64, 2)
    trailing = list(tensors[0].shape[1:])
    arrays = []
    offsets = [0]
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point() != floating or list(tensor.shape[1:]) != trailing:
            raise ValueError(
                f"output {name!r} of datum {index}: {tensor.dtype} {list(tensor.shape)} does not match datum 0's "
                f"{tensors[0].dtype} {list(tensors[0].shape)} (one record needs one dtype and one trailing shape)"
            )
        arrays.append(_tensor_bytes(tensor, dtype))
        offsets.append(offsets[-1] + len(arrays[-1]))
    message = _bytes_field(1, b"".join(arrays)) + _bytes_field(2, struct.pack(f"<{len(offsets)}q", *offsets))
    message += _varint_field(3, code)
    if trailing:
        message += _bytes_field(4, b"".join(_varint_bytes(dim) for dim in trailing))
    return message


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: the datums' outputs in ArrayRecords, one for each run of datums whose
    outputs share their dtypes and trailing shapes (the SDK joins them: ragged outputs, such as top-K
    logprobs beside plain ones, come as several rectangular records); a 0-D output arrives as shape [1]."""
    for key in metrics:
        name, _, reduction = key.partition(":")
        if not name or reduction not in _REDUCTIONS:
            raise ValueError(f"metric {key!r} must be 'name:reduction' with a reduction in {sorted(_REDUCTIONS)}")
    names = list(outputs[0]) if outputs else []
    for index, output in enumerate(outputs):
        if set(output) != set(names):
            raise ValueError(f"datum {index} has outputs {sorted(output)}, datum 0 has {sorted(names)}")
    kind = lambda o: [(o[n].dtype.is_floating_point, tuple(o[n].shape[1:])) for n in names]  # noqa: E731
    runs: list[list[dict]] = []
    for output in outputs:
        if runs and kind(runs[-1][0]) == kind(output):
            runs[-1].append(output)
        else:
            runs.append([output])
    parts = [_bytes_field(1, b"ArrayRecord")]
    for run in runs or [[]]:
        record = [_bytes_field(1, b"ArrayRecord"), _varint_field(3, len(run))]
        for name in names:
            entry = _bytes_field(1, name.encode()) + _bytes_field(2, _batched_tensor(name, [o[name] for o in run]))
            record.append(_bytes_field(2, entry))
        parts.append(_bytes_field(2, b"".join(record)))
    for key, value in metrics.items():
        value_field = _varint_bytes(2 << 3 | 1) + struct.pack("<d", value)  # field 2, fixed64
        parts.append(_bytes_field(3, _bytes_field(1, key.encode()) + value_field))
    return b"".join(parts)


def sample_response(
    sequences: list[tuple[list[int], list[float] | None, str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """A ``SampleResponse``: each sequence is (tokens, logprobs or None, stop reason "stop" | "length");
    ``prompt_logprobs`` None leaves the field out, and its None entries are sent as NaN."""
    parts = []
    for tokens, logprobs, stop_reason in sequences:
        if stop_reason not in _STOP_REASONS:
            raise ValueError(f"stop reason {stop_reason!r} is not one of {sorted(_STOP_REASONS)}")
        message = _varint_field(1, _STOP_REASONS[stop_reason])
        message += _bytes_field(2, struct.pack(f"<{len(tokens)}i", *tokens))
        if logprobs is not None:
            if len(logprobs) != len(tokens):
                raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
            message += _bytes_field(3, struct.pack(f"<{len(logprobs)}f", *logprobs))
        parts.append(_bytes_field(1, message))
    if prompt_logprobs is not None:
        values = [math.nan if value is None else value for value in prompt_logprobs]
        parts.append(_bytes_field(2, struct.pack(f"<{len(values)}f", *values)))
    return b"".join(parts)
