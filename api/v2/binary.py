"""The binary tensor data extension (Triton's, used by its clients by default).

A request whose ``Inference-Header-Content-Length`` header is L carries a JSON header of L
bytes, then the raw bytes of every input whose ``parameters.binary_data_size`` is set, in input
order: numbers little-endian, BYTES elements each as a 4-byte little-endian length and its
bytes. NaN in a binary floating-point tensor is a missing value (JSON has ``null`` for that).
The response is binary the same way when an output asks for it (``parameters.binary_data``,
or the request's ``parameters.binary_data_output``).
"""

from __future__ import annotations

import struct

import numpy as np

from api.errors import InputError
from api.v2.protocol import InferInput

HEADER = "inference-header-content-length"
NUMPY = {
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "BOOL": "?",
}


def split(body: bytes, header_length: str) -> tuple[bytes, bytes]:
    """The JSON header and the binary part of a request body."""
    if not header_length.isdigit() or int(header_length) > len(body):
        raise InputError(
            "Inference-Header-Content-Length",
            f"{header_length!r}: not a length within the body ({len(body)} bytes)",
        )
    n = int(header_length)
    return body[:n], body[n:]


def _bytes_elements(raw: bytes, field: str) -> list[bytes]:
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InputError(field, "truncated BYTES element length")
        (size,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + size > len(raw):
            raise InputError(field, "truncated BYTES element")
        out.append(raw[pos : pos + size])
        pos += size
    return out


def decode(inputs: list[InferInput], binary: bytes) -> list[list | None]:
    """Each input's values: its JSON ``data``, or its slice of the binary part, decoded."""
    values: list[list | None] = []
    pos = 0
    for k, tensor in enumerate(inputs):
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            values.append(tensor.data)
            continue
        field = f"inputs.{k}.parameters.binary_data_size"
        if tensor.data is not None:
            raise InputError(f"inputs.{k}.data", "give data or binary_data_size, not both")
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or pos + size > len(binary)
        ):
            raise InputError(
                field,
                f"{size!r}: not a size within the binary data ({len(binary) - pos} bytes left)",
            )
        raw = binary[pos : pos + size]
        pos += size
        if tensor.datatype == "BYTES":
            values.append(_bytes_elements(raw, field))
        elif tensor.datatype in NUMPY:
            dtype = np.dtype(NUMPY[tensor.datatype])
            if size % dtype.itemsize:
                raise InputError(
                    field, f"{size} bytes is not a whole number of {tensor.datatype} values"
                )
            array = np.frombuffer(raw, dtype=dtype)
            values.append([None if v != v else v for v in array.tolist()])  # NaN: missing
        else:
            raise InputError(f"inputs.{k}.datatype", f"{tensor.datatype} has no binary form here")
    if pos != len(binary):
        raise InputError("body", f"{len(binary) - pos} bytes of binary data belong to no input")
    return values


def wants_binary(request_parameters: dict | None, output_parameters: dict | None) -> bool:
    if output_parameters and "binary_data" in output_parameters:
        return bool(output_parameters["binary_data"])
    return bool((request_parameters or {}).get("binary_data_output", False))


def encode(predictions: list[float]) -> bytes:
    """FP32 predictions as raw little-endian bytes."""
    return np.asarray(predictions, dtype="<f4").tobytes()
