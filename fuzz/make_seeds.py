#!/usr/bin/env python3
# Writes the seed corpora of the fuzz targets into OUT/<target>/ from the golden fixtures, so no
# large binary file is committed: the fuzzers start from real headers and configs, not from
# nothing. Usage: make_seeds.py FIXTURE_DIR OUT
#   safetensors: each fixture cut down to a few small tensors (a valid file of a few KB: the
#                header with its real metadata is what matters), its bare header (the data
#                section missing: the offsets run past the end), and tiny files of every dtype
#                (scalars, empty and unaligned tensors) that the fuzzer mutates fastest.
#   config:      each fixture's `config` and `config_full` metadata JSON.
import json
import os
import struct
import sys

fixtures, out = sys.argv[1], sys.argv[2]
for sub in ("safetensors", "config"):
    os.makedirs(os.path.join(out, sub), exist_ok=True)


def write(sub, name, data):
    with open(os.path.join(out, sub, name), "wb") as f:
        f.write(data)


def safetensors_image(metadata, tensors):
    header = {"__metadata__": metadata} if metadata else {}
    data, offset = b"", 0
    for name, (dtype, shape, raw) in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


DTYPE_SIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1}
for dtype, size in DTYPE_SIZES.items():
    for shape in ([], [2], [0, 3], [2, 2]):
        n = 1
        for d in shape:
            n *= d
        raw = bytes((i * 37 + 1) % 2 if dtype == "BOOL" else (i * 37 + 1) % 251 for i in range(n * size))
        name = f"tiny-{dtype}-{'x'.join(map(str, shape)) or 'scalar'}.safetensors"
        write("safetensors", name, safetensors_image({"k": "v"} if shape == [2] else {}, [("t", (dtype, shape, raw))]))
# Two tensors, the second at an offset its dtype does not divide (the copying path of the reader).
write("safetensors", "tiny-unaligned.safetensors",
      safetensors_image({}, [("a", ("BOOL", [1], b"\x01")), ("b", ("F32", [1], b"\x00\x00\x80\x3f"))]))

DATA_BUDGET = 4096  # bytes of tensor data kept per cut-down fixture
for fname in sorted(os.listdir(fixtures)):
    if not fname.endswith(".safetensors"):
        continue
    stem = fname[: -len(".safetensors")]
    with open(os.path.join(fixtures, fname), "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    metadata = header.pop("__metadata__", {})
    kept, used = [], 0
    for name, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = v["data_offsets"]
        if used + (e - b) <= DATA_BUDGET:
            kept.append((name, (v["dtype"], v["shape"], blob[base + b : base + e])))
            used += e - b
    write("safetensors", stem + ".safetensors", safetensors_image(metadata, kept))
    write("safetensors", stem + ".header-only", blob[:base])
    for key in ("config", "config_full"):
        if key in metadata:
            write("config", f"{stem}.{key}.json", metadata[key].encode())
