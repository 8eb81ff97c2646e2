"""safetensors files written and read by hand (no `safetensors` package; torch only).

Layout: u64 little-endian header length N, N bytes of JSON header, then the raw little-endian
tensor data. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the data section) and holds `__metadata__` (string -> string).
"""
import json
import struct
import sys

import torch

# safetensors dtype names of the torch dtypes a golden uses (BOOL is one byte per element).
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


def _tensor_bytes(t):
    """The tensor's elements as little-endian bytes, in row-major order."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    # Reinterpret as bytes: a view of the flat tensor (bool is stored one byte per element).
    flat = t.reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    if sys.byteorder != "little" and flat.element_size() > 1:
        raise SafetensorsError("writing safetensors on a big-endian host is not supported")
    try:
        return raw.numpy().tobytes()
    except (ImportError, RuntimeError):  # torch built without numpy: slower, same bytes
        return bytes(raw.tolist())


def write(path, tensors, metadata=None):
    """Writes `tensors` (name -> torch.Tensor, in the order given) and `metadata` (str -> str)."""
    header = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise SafetensorsError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is not a tensor name")
        if not isinstance(t, torch.Tensor):
            raise SafetensorsError(f"{name}: not a tensor ({type(t).__name__})")
        if t.dtype not in DTYPES:
            raise SafetensorsError(f"{name}: dtype {t.dtype} has no safetensors name here")
        b = _tensor_bytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * ((8 - len(head) % 8) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def read(path):
    """Returns (tensors: name -> torch.Tensor in file order, metadata: dict)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise SafetensorsError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise SafetensorsError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not JSON: {e}") from None
    meta = header.pop("__metadata__", {}) or {}
    data = memoryview(raw)[8 + n :]
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dt = TORCH_DTYPES.get(info["dtype"])
        if dt is None:
            raise SafetensorsError(f"{path}: {name}: unknown dtype {info['dtype']}")
        a, b = info["data_offsets"]
        shape = info["shape"]
        if b > len(data) or a > b:
            raise SafetensorsError(f"{path}: {name}: data offsets {a}..{b} outside the data section")
        if a == b:
            out[name] = torch.empty(shape, dtype=dt)
            continue
        buf = bytearray(data[a:b])
        t = torch.frombuffer(buf, dtype=torch.uint8)
        t = t.to(torch.bool) if dt == torch.bool else t.view(dt)
        out[name] = t.reshape(shape)
    return out, meta
