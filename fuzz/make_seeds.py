#!/usr/bin/env python3
# Writes the seed corpora of the fuzz targets into OUT/<target>/ from the golden fixtures, so no
# large binary file is committed: the fuzzers start from real headers and configs, not from
# nothing. Usage: make_seeds.py FIXTURE_DIR OUT
#   safetensors: each fixture cut down to a few small tensors (a valid file of a few KB: the
#                header with its real metadata is what matters), its bare header (the data
#                section missing: the offsets run past the end), and tiny files of every dtype
#                (scalars, empty and unaligned tensors) that the fuzzer mutates fastest.
#   config:      each fixture's `config` and `config_full` metadata JSON.
#   torch:       small files written by torch.save (every dtype, views, shared storages, nested
#                containers, non-tensor leaves, both pickle protocols, the legacy format); only
#                when this python has torch (Debian's python3-torch), else skipped with a note.
import json
import os
import struct
import sys

fixtures, out = sys.argv[1], sys.argv[2]
for sub in ("safetensors", "config", "torch"):
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


def torch_seeds():
    try:
        import collections
        import torch
    except ImportError:
        print("make_seeds.py: no torch in this python: no .pt seeds", file=sys.stderr)
        return
    d = os.path.join(out, "torch")
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    every = {
        "f64": torch.tensor([1.0, -2.5], dtype=torch.float64),
        "f32": torch.tensor([[1.5, -3.0], [0.25, 7.0]]),
        "bf16": torch.tensor([1.0, -0.333], dtype=torch.bfloat16),
        "f16": torch.tensor([65504.0, 0.1], dtype=torch.float16),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "i32": torch.tensor([-7, 0, 2**31 - 1], dtype=torch.int32),
        "bool": torch.tensor([True, False, True]),
    }
    files = {
        "bare": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
        "scalar": torch.tensor(42.0),
        "empty": torch.zeros(0, 3),
        "one_entry": {"w": torch.ones(2)},
        "every_dtype": every,
        "views": {"base": base, "cols": base[:, 1:3], "t": base.t(), "row": base[2]},
        "nested": collections.OrderedDict(
            model={"layers": [{"weight": torch.ones(2, 2)}, {"weight": torch.zeros(2, 2)}]},
            step=3, lr=1.5e-4, name="run", flag=True, nothing=None, dtype=torch.float32,
            pair=(torch.ones(1), 2)),
        "linear": torch.nn.Linear(3, 2).state_dict(),
    }
    torch.manual_seed(0)
    for name, obj in files.items():
        torch.save(obj, os.path.join(d, name + ".pt"))
    torch.save(every, os.path.join(d, "every_dtype.protocol4.pt"), pickle_protocol=4)
    torch.save(files["views"], os.path.join(d, "views.legacy.pt"), _use_new_zipfile_serialization=False)
    # The pickles alone too: fuzz_torch wraps such inputs in a valid zip, so their mutations reach
    # the pickle machine (storage keys 0..7 of 256 bytes each, as the target provides them).
    import zipfile
    for name in list(os.listdir(d)):
        if name.endswith(".pt") and zipfile.is_zipfile(os.path.join(d, name)):
            with zipfile.ZipFile(os.path.join(d, name)) as z:
                pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
                if pkl:
                    write("torch", name[: -len(".pt")] + ".pkl", z.read(pkl[0]))


torch_seeds()
