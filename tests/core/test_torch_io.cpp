// .pt files: what torch.save writes (Debian's python3-torch, run by the tests) read without
// LibTorch and compared with the values Python itself prints; LibTorch's writer round trips and
// is read back by Python; hostile archives and pickles are one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/torch_io.h"
#include "tests/core/corrupt_safetensors.h"
#include "tests/optional_dependency.h"

using namespace twin;
using namespace std::string_literals;  // "...\x00..."s keeps the NUL bytes of a pickle
using nlohmann::json;
using twin::testing::TempDir;

namespace {

// The interpreter python3-torch installs into; `python3` on PATH may be another one without torch.
constexpr const char* kPython = "/usr/bin/python3";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string quote(const std::string& s) { return "'" + s + "'"; }  // paths from TempDir: no quotes inside

// Empty when /usr/bin/python3 imports torch, else why not (asked once per process).
const std::optional<std::string>& python_torch_missing() {
  static const std::optional<std::string> why = []() -> std::optional<std::string> {
    const std::string cmd = std::string(kPython) + " -c 'import torch' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return std::nullopt;
    return std::string(kPython) + " cannot import torch (install python3-torch: ci/setup does)";
  }();
  return why;
}

#define REQUIRE_PYTHON_TORCH()                                              \
  do {                                                                      \
    if (const auto& why = python_torch_missing()) TWIN_SKIP_OPTIONAL(*why); \
  } while (0)

// Run by every generator script: save(obj, file) writes <dir>/<file> with torch.save and prints
// one JSON line with what the file holds, flattened the way twin names it (dotted names, list and
// tuple items by index, a bare tensor "tensor"), values from torch itself, non-tensor leaves as
// Python's repr (a str as itself).
const char* kPrelude = R"PY(
import collections, json, math, sys
import torch
OUT = sys.argv[1]
DT = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
      torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}
def values(t):
    t = t.contiguous().flatten()
    if t.dtype == torch.bool:
        return [bool(x) for x in t.tolist()]
    if t.is_floating_point():
        return [x if math.isfinite(x) else repr(x) for x in t.double().tolist()]
    return t.tolist()
def flat(obj, name, out):
    key = name or "tensor"
    child = lambda k: f"{name}.{k}" if name else str(k)
    if isinstance(obj, torch.Tensor):
        out["tensors"].append({"name": key, "dtype": DT[obj.dtype], "shape": list(obj.shape), "values": values(obj)})
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flat(v, child(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flat(v, child(i), out)
    else:
        out["metadata"][key] = obj if isinstance(obj, str) else repr(obj)
def save(obj, file, **kw):
    torch.save(obj, f"{OUT}/{file}", **kw)
    out = {"file": file, "tensors": [], "metadata": {}}
    flat(obj, "", out)
    print(json.dumps(out))
)PY";

// Runs the prelude + `script` with the directory as argv[1]; returns the JSON lines it printed.
std::vector<json> run_python(const TempDir& dir, const std::string& script) {
  const std::string py = dir.file("gen.py"), out = dir.file("gen.out"), err = dir.file("gen.err");
  twin::testing::write_bytes(py, std::string(kPrelude) + script);
  const std::string cmd = std::string(kPython) + " " + quote(py) + " " + quote(dir.path().string()) + " >" +
                          quote(out) + " 2>" + quote(err);
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    ADD_FAILURE() << "python failed (" << rc << "): " << slurp(err);
    return {};
  }
  std::vector<json> lines;
  std::istringstream in(slurp(out));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(json::parse(line));
  return lines;
}

double expected_value(const json& v) {
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "nan") return NAN;
    if (s == "inf") return INFINITY;
    if (s == "-inf") return -INFINITY;
    ADD_FAILURE() << "unexpected value " << s;
  }
  return v.get<double>();
}

// Reads the file twin's way and checks every name, dtype, shape, value (bit for bit: -0.0 and
// NaN too) and metadata entry against what Python printed for it.
TorchFile expect_matches_python(const TempDir& dir, const json& want) {
  const std::string path = dir.file(want["file"].get<std::string>());
  SCOPED_TRACE(path);
  TorchFile f;
  try {
    f = read_torch_file(path);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return f;
  }
  const json& tensors = want["tensors"];
  EXPECT_EQ(f.tensors.size(), tensors.size());
  for (std::size_t i = 0; i < std::min(f.tensors.size(), tensors.size()); ++i) {
    const auto& [name, t] = f.tensors[i];
    const json& w = tensors[i];
    EXPECT_EQ(name, w["name"].get<std::string>());
    EXPECT_EQ(std::string(dtype_name(t.dtype())), w["dtype"].get<std::string>()) << name;
    EXPECT_EQ(t.shape(), w["shape"].get<Shape>()) << name;
    const json& values = w["values"];
    if (static_cast<std::size_t>(t.numel()) != values.size()) {
      ADD_FAILURE() << name << ": " << t.numel() << " elements, Python printed " << values.size();
      continue;
    }
    for (std::size_t k = 0; k < values.size(); ++k) {
      if (t.dtype() == DType::I64) {
        EXPECT_EQ(t.data<std::int64_t>()[k], values[k].get<std::int64_t>()) << name << "[" << k << "]";
        continue;
      }
      const double got = t.at_f64(static_cast<std::int64_t>(k)), exp = expected_value(values[k]);
      if (std::isnan(exp)) {
        EXPECT_TRUE(std::isnan(got)) << name << "[" << k << "]";
      } else {
        EXPECT_EQ(got, exp) << name << "[" << k << "]";
        EXPECT_EQ(std::signbit(got), std::signbit(exp)) << name << "[" << k << "]";
      }
    }
  }
  EXPECT_EQ(f.metadata, (want["metadata"].get<std::map<std::string, std::string>>()));
  return f;
}

std::vector<std::pair<std::string, Tensor>> every_dtype() {
  return {
      {"layer.weight", Tensor::from_vector<float>({2, 3}, {1, -2, 3.5f, 1e-40f, -0.0f, 6})},
      {"f64", Tensor::from_vector<double>({2}, {1e300, -NAN})},
      {"bf16", Tensor::from_doubles(DType::BF16, {3}, {1.0, -0.3333, INFINITY})},
      {"f16", Tensor::from_doubles(DType::F16, {2, 1}, {65504.0, 6e-8})},
      {"i64", Tensor::from_vector<std::int64_t>({2}, {INT64_MIN, 7})},
      {"i32", Tensor::from_vector<std::int32_t>({1}, {-3})},
      {"mask", Tensor::from_vector<bool>({2, 2}, {true, false, false, true})},
      {"scalar", Tensor::from_vector<float>({}, {2.5f})},
  };
}

std::string torch_error(const std::string& path) {
  try {
    read_torch_file(path);
  } catch (const TorchFileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no TorchFileError for " << path;
  return "";
}

std::string bytes_error(const std::string& bytes) {
  try {
    read_torch_bytes("mem.pt", reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  } catch (const TorchFileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no TorchFileError";
  return "";
}

// ---- a hand-built torch.save archive, for the hostile cases --------------------------------------

std::string le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

std::uint32_t crc32_bitwise(const std::string& s) {  // the zip CRC, bit by bit
  std::uint32_t c = 0xFFFFFFFFu;
  for (const unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

struct Entry {
  std::string name, data;
  std::uint16_t method = 0;
};

// A zip archive of stored entries (the layout of APPNOTE 4.3.7 / 4.3.12 / 4.3.16).
std::string zip_of(const std::vector<Entry>& entries) {
  std::string out, cd;
  for (const Entry& e : entries) {
    const std::string crc = le(crc32_bitwise(e.data), 4), size = le(e.data.size(), 4), n = le(e.name.size(), 2);
    const std::string common = le(20, 2) + le(0, 2) + le(e.method, 2) + le(0, 4) + crc + size + size + n + le(0, 2);
    cd +=
        le(0x02014b50, 4) + le(20, 2) + common + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) + le(out.size(), 4) + e.name;
    out += le(0x04034b50, 4) + common + e.name + e.data;
  }
  const std::size_t n = entries.size(), cd_at = out.size();
  return out + cd + le(0x06054b50, 4) + le(0, 4) + le(n, 2) + le(n, 2) + le(cd.size(), 4) + le(cd_at, 4) + le(0, 2);
}

// Pickle pieces (protocol 2), as torch.save emits them.
std::string uni(const std::string& s) { return "X" + le(s.size(), 4) + s; }
std::string i64(std::int64_t v) { return "\x8a\x08" + le(static_cast<std::uint64_t>(v), 8); }  // LONG1
std::string tuple_of(const std::vector<std::int64_t>& v) {
  std::string s = "(";
  for (const auto x : v) s += i64(x);
  return s + "t";
}
// _rebuild_tensor_v2(storage '0' of `type` with `numel` elements, offset, sizes, strides, False, OrderedDict())
std::string tensor_pickle(const std::string& type, std::int64_t numel, std::int64_t offset,
                          const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides) {
  return "ctorch._utils\n_rebuild_tensor_v2\n((" + uni("storage") + "ctorch\n" + type + "\n" + uni("0") + uni("cpu") +
         i64(numel) + "tQ" + i64(offset) + tuple_of(sizes) + tuple_of(strides) +
         "\x89"
         "ccollections\nOrderedDict\n)RtR";
}
// {"x": tensor} with storage entry `data`.
std::string archive(const std::string& tensor, const std::string& data) {
  return zip_of({{"archive/data.pkl", "\x80\x02}" + uni("x") + tensor + "s."}, {"archive/data/0", data}});
}
const std::string kFourFloats =
    le(0x3f800000, 4) + le(0x40000000, 4) + le(0x40400000, 4) + le(0x40800000, 4);  // 1 2 3 4

}  // namespace

// ---- files written by torch.save ------------------------------------------------------------------

TEST(TorchSave, OneEntryDict) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "one.pt"))PY");
  ASSERT_EQ(want.size(), 1u);
  const TorchFile f = expect_matches_python(dir, want[0]);
  // Closed form too: arange.
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].first, "a");
  EXPECT_EQ(f.tensors[0].second.shape(), (Shape{2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(f.tensors[0].second.at_f64(i), i);
}

TEST(TorchSave, NestedDicts) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(
save({"a": torch.arange(3),
      "b": {"c": torch.full((2, 2), 0.5, dtype=torch.bfloat16),
            "d": {"e": torch.tensor([True, False]), "n": 7}},
      "z": torch.tensor([-1.0, float("inf"), float("nan"), -0.0], dtype=torch.float16)}, "nested.pt")
)PY");
  ASSERT_EQ(want.size(), 1u);
  const TorchFile f = expect_matches_python(dir, want[0]);
  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_EQ(f.tensors[2].first, "b.d.e");
  EXPECT_EQ(f.metadata.at("b.d.n"), "7");
}

TEST(TorchSave, OrderedDictOfEveryDtypeAndAModuleStateDict) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  // A state_dict is an OrderedDict carrying a `_metadata` attribute (pickled with BUILD).
  const auto want = run_python(dir, R"PY(
od = collections.OrderedDict()
for dt in [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]:
    od[str(dt)] = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * 1.25 - 4).to(dt)
od["bool"] = torch.tensor([[True, False, True]])
od["big"] = torch.tensor([-2**63, 2**63 - 1, 2**40])
od["tiny"] = torch.tensor([1e-40, -1e-45, 6e-8], dtype=torch.float32)
save(od, "ordered.pt")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
sd = m.state_dict()
assert hasattr(sd, "_metadata")
save(sd, "state_dict.pt")
)PY");
  ASSERT_EQ(want.size(), 2u);
  expect_matches_python(dir, want[0]);
  const TorchFile sd = expect_matches_python(dir, want[1]);
  ASSERT_EQ(sd.tensors.size(), 4u);
  EXPECT_EQ(sd.tensors[0].first, "0.weight");
  EXPECT_EQ(sd.tensors[3].first, "1.bias");
}

TEST(TorchSave, ListsAndTuples) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(
t = torch.arange(4, dtype=torch.int32)
save([t, (t * 2, torch.ones(1)), 3, "text", None, []], "list.pt")
save((torch.zeros(2, dtype=torch.bool), [torch.tensor(1.5, dtype=torch.float64)]), "tuple.pt")
save({"layers": [{"w": torch.eye(2)}, {"w": torch.eye(2) * 2}]}, "dict_of_list.pt")
)PY");
  ASSERT_EQ(want.size(), 3u);
  const TorchFile l = expect_matches_python(dir, want[0]);
  ASSERT_EQ(l.tensors.size(), 3u);
  EXPECT_EQ(l.tensors[1].first, "1.0");
  EXPECT_EQ(l.metadata.at("3"), "text");
  expect_matches_python(dir, want[1]);
  const TorchFile d = expect_matches_python(dir, want[2]);
  ASSERT_EQ(d.tensors.size(), 2u);
  EXPECT_EQ(d.tensors[1].first, "layers.1.w");
}

TEST(TorchSave, ViewsHonourOffsetAndStrides) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(
t = torch.arange(20, dtype=torch.float32).reshape(4, 5)
b = t.to(torch.bfloat16)
views = {"slice": t[1:, 1:3], "transposed": t.t(), "narrow": t.narrow(1, 2, 3), "row": t[2],
         "element": t[3, 4], "every_other": t[::2, ::3], "expanded": torch.arange(3.).expand(2, 3),
         "bf16_view": b.t()[1:4, 1:], "permuted": t.reshape(2, 2, 5).permute(2, 0, 1)}
assert not views["slice"].is_contiguous() and views["row"].storage_offset() == 10
save(views, "views.pt")
)PY");
  ASSERT_EQ(want.size(), 1u);
  const TorchFile f = expect_matches_python(dir, want[0]);
  ASSERT_EQ(f.tensors.size(), 9u);
  // Closed form: t[i][j] = 5 i + j.
  const Tensor& slice = f.tensors[0].second;  // t[1:, 1:3]
  ASSERT_EQ(slice.shape(), (Shape{3, 2}));
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) EXPECT_EQ(slice.at_f64(i * 2 + j), 5 * (i + 1) + (j + 1));
  EXPECT_EQ(f.tensors[4].second.at_f64(0), 19.0);  // t[3, 4]
}

TEST(TorchSave, TensorsSharingOneStorage) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(
base = torch.arange(10, dtype=torch.int64)
emb = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
save({"a": base, "b": base, "c": base[2:5], "d": base.view(2, 5), "tied": [emb, emb.t()]}, "shared.pt")
)PY");
  ASSERT_EQ(want.size(), 1u);
  const TorchFile f = expect_matches_python(dir, want[0]);
  ASSERT_EQ(f.tensors.size(), 6u);
  EXPECT_EQ(f.tensors[2].second.data<std::int64_t>()[0], 2);
  // Each name owns its copy: a shared storage is not aliased in twin's tensors.
  EXPECT_NE(f.tensors[0].second.raw(), f.tensors[1].second.raw());
}

TEST(TorchSave, BareTensorsAndMetadataLeaves) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto want = run_python(dir, R"PY(
save(torch.tensor(2.5), "scalar.pt")
save(torch.arange(3.), "bare.pt")
save({"w": torch.ones(1), "step": 10, "neg": -5, "big": 2**40, "neg_big": -2**40, "lr": 1e-4,
      "eps": 1.5e-7, "huge": 1e16, "name": "run", "flag": False, "on": True, "none": None,
      "dtype": torch.bfloat16, "inf": float("inf")}, "meta.pt")
)PY");
  ASSERT_EQ(want.size(), 3u);
  const TorchFile s = expect_matches_python(dir, want[0]);
  ASSERT_EQ(s.tensors.size(), 1u);
  EXPECT_EQ(s.tensors[0].first, "tensor");
  EXPECT_EQ(s.tensors[0].second.dim(), 0);
  expect_matches_python(dir, want[1]);
  const TorchFile m = expect_matches_python(dir, want[2]);
  EXPECT_EQ(m.metadata.at("dtype"), "torch.bfloat16");
  EXPECT_EQ(m.metadata.at("lr"), "0.0001");
}

TEST(TorchSave, NewerPickleProtocols) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  // Protocol 4/5 bring FRAME, MEMOIZE, SHORT_BINUNICODE and STACK_GLOBAL.
  const auto want = run_python(dir, R"PY(
obj = {"a": torch.arange(6.).reshape(2, 3).t(), "b": {"c": [torch.ones(2, dtype=torch.float16), 3.5]},
       "od": collections.OrderedDict(x=torch.tensor([7]))}
save(obj, "p4.pt", pickle_protocol=4)
save(obj, "p5.pt", pickle_protocol=5)
)PY");
  ASSERT_EQ(want.size(), 2u);
  expect_matches_python(dir, want[0]);
  expect_matches_python(dir, want[1]);
}

TEST(TorchSave, UnsupportedDtypesAndObjectsAreNamedErrors) {
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto done = run_python(dir, R"PY(
torch.save({"ok": torch.ones(1), "q": torch.zeros(2, dtype=torch.int8)}, OUT + "/int8.pt")
torch.save({"c": torch.zeros(2, dtype=torch.complex64)}, OUT + "/complex.pt")
torch.save(torch.nn.Linear(2, 2), OUT + "/module.pt")
torch.save({"w": torch.ones(1)}, OUT + "/legacy.pt", _use_new_zipfile_serialization=False)
print("{}")
)PY");
  ASSERT_EQ(done.size(), 1u);
  std::string m = torch_error(dir.file("int8.pt"));
  EXPECT_NE(m.find("tensor 'q' has dtype int8"), std::string::npos) << m;
  m = torch_error(dir.file("complex.pt"));
  EXPECT_NE(m.find("tensor 'c' has dtype complex64"), std::string::npos) << m;
  m = torch_error(dir.file("module.pt"));
  EXPECT_NE(m.find("unsupported Python object 'torch.nn.modules.linear.Linear'"), std::string::npos) << m;
  m = torch_error(dir.file("legacy.pt"));
  EXPECT_NE(m.find("not a torch.save zip archive"), std::string::npos) << m;
}

// ---- LibTorch's writer ------------------------------------------------------------------------

TEST(TorchIO, DictOfEveryDtypeRoundTrips) {
  if (!torch_write_available()) TWIN_SKIP_OPTIONAL("built without LibTorch: write_torch_file is unavailable");
  TempDir dir;
  const std::string path = dir.file("state.pt");
  const auto tensors = every_dtype();
  write_torch_file(path, tensors);
  const TorchFile f = read_torch_file(path);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, want] = tensors[i];
    const auto& [got_name, got] = f.tensors[i];  // a dict keeps insertion order
    EXPECT_EQ(got_name, name);
    EXPECT_EQ(got.dtype(), want.dtype()) << name;
    EXPECT_EQ(got.shape(), want.shape()) << name;
    ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << name;
  }
}

TEST(TorchIO, BareTensorIsNamedTensor) {
  if (!torch_write_available()) TWIN_SKIP_OPTIONAL("built without LibTorch: write_torch_file is unavailable");
  TempDir dir;
  const std::string path = dir.file("t.pt");
  write_torch_file(path, {{"", Tensor::from_vector<float>({3}, {1, 2, 3})}});
  const TorchFile f = read_torch_file(path);
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].first, "tensor");
  EXPECT_EQ(f.tensors[0].second.at_f64(2), 3.0);
}

// What LibTorch's writer makes, torch.load reads with the same values.
TEST(TorchIO, PythonLoadsWhatTwinWrites) {
  if (!torch_write_available()) TWIN_SKIP_OPTIONAL("built without LibTorch: write_torch_file is unavailable");
  REQUIRE_PYTHON_TORCH();
  TempDir dir;
  const auto tensors = every_dtype();
  write_torch_file(dir.file("twin.pt"), tensors);
  const auto got = run_python(dir, R"PY(
d = torch.load(OUT + "/twin.pt")
print(json.dumps([{"name": k, "dtype": DT[v.dtype], "shape": list(v.shape), "values": values(v)} for k, v in d.items()]))
)PY");
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got[0].size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const json& w = got[0][i];
    EXPECT_EQ(w["name"], name);
    EXPECT_EQ(w["dtype"], dtype_name(t.dtype())) << name;
    EXPECT_EQ(w["shape"].get<Shape>(), t.shape()) << name;
    ASSERT_EQ(w["values"].size(), static_cast<std::size_t>(t.numel())) << name;
    for (std::size_t k = 0; k < w["values"].size(); ++k) {
      if (t.dtype() == DType::I64) {
        EXPECT_EQ(w["values"][k].get<std::int64_t>(), t.data<std::int64_t>()[k]) << name;
        continue;
      }
      const double want = t.at_f64(static_cast<std::int64_t>(k)), py = expected_value(w["values"][k]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(py)) << name << "[" << k << "]";
      } else {
        EXPECT_EQ(py, want) << name << "[" << k << "]";
        EXPECT_EQ(std::signbit(py), std::signbit(want)) << name << "[" << k << "]";
      }
    }
  }
}

TEST(TorchIO, ArchiveWrittenByLibTorchCutShortIsAnError) {
  if (!torch_write_available()) TWIN_SKIP_OPTIONAL("built without LibTorch: write_torch_file is unavailable");
  TempDir dir;
  const std::string good = dir.file("good.pt");
  write_torch_file(good, every_dtype());
  const std::string bytes = slurp(good);
  for (const std::size_t keep : {bytes.size() / 2, bytes.size() - 1, std::size_t{30}}) {
    const std::string cut = dir.file("cut.pt");
    twin::testing::write_bytes(cut, bytes.substr(0, keep));
    const std::string m = torch_error(cut);
    EXPECT_EQ(m.rfind(cut + ": ", 0), 0u) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

// ---- malformed and hostile input ------------------------------------------------------------------

TEST(TorchIO, BadFilesAreOneLineErrorsNamingTheFile) {
  TempDir dir;
  const std::string missing = dir.file("missing.pt");
  std::string m = torch_error(missing);
  EXPECT_EQ(m.rfind(missing + ": cannot open", 0), 0u) << m;

  const std::string legacy = dir.file("legacy.pt");
  twin::testing::write_bytes(legacy, std::string("\x80\x02\x8a\x0a", 4) + std::string(40, 'x'));
  m = torch_error(legacy);
  EXPECT_NE(m.find("not a torch.save zip archive"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;

  const std::string broken = dir.file("broken.pt");
  twin::testing::write_bytes(broken, std::string("PK\x03\x04", 4) + std::string(100, '\0'));
  m = torch_error(broken);
  EXPECT_EQ(m.rfind(broken + ": truncated zip archive: end of central directory not found", 0), 0u) << m;
}

// The hand-built archive is sound: the hostile variants below fail for their own fault.
TEST(TorchIO, HandBuiltArchiveReads) {
  const std::string ok = archive(tensor_pickle("FloatStorage", 4, 1, {3}, {1}), kFourFloats);
  const TorchFile f = read_torch_bytes("mem.pt", reinterpret_cast<const std::uint8_t*>(ok.data()), ok.size());
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].first, "x");
  EXPECT_EQ(f.tensors[0].second.to_f64(), (std::vector<double>{2, 3, 4}));
}

TEST(TorchIO, HostileInputsAreOneLineErrors) {
  const auto t = [](const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides,
                    std::int64_t numel = 4, std::int64_t offset = 0, const std::string& type = "FloatStorage") {
    return archive(tensor_pickle(type, numel, offset, sizes, strides), kFourFloats);
  };
  const std::string good = t({4}, {1});
  std::string bad_crc = good;
  bad_crc[bad_crc.find(kFourFloats)] ^= 1;
  std::string cd_outside = good;
  cd_outside[cd_outside.size() - 3] = '\x7f';  // the top byte of the central directory's offset
  std::string long_entry = good;
  long_entry.replace(long_entry.rfind(std::string("\x50\x4b\x01\x02", 4)) + 20, 8, le(1000, 4) + le(1000, 4));
  const std::string self_list =
      "\x80\x02]q\x00h\x00"
      "a."s;
  // A list of 40 levels each holding the level below twice: 2^40 leaves by reference.
  std::string doubling = "\x80\x02]q\x00"s;
  for (int k = 1; k <= 40; ++k) doubling += "](h" + le(k - 1, 1) + "h" + le(k - 1, 1) + "eq" + le(k, 1);
  doubling += ".";
  const struct {
    const char* name;
    std::string bytes;
    const char* fault;
  } cases[] = {
      {"empty", "", "not a torch.save zip archive"},
      {"truncated zip", good.substr(0, good.size() / 2), "truncated zip archive: end of central directory not found"},
      {"bad opcode", zip_of({{"archive/data.pkl", "\x80\x02\xff."}}), "unsupported pickle opcode 0xff at byte 2"},
      {"no STOP", zip_of({{"archive/data.pkl", "\x80\x02}"}}), "ends without STOP"},
      {"stack underflow", zip_of({{"archive/data.pkl", "\x80\x02s."}}), "stack underflow at byte 2"},
      {"memo read before written", zip_of({{"archive/data.pkl", "\x80\x02h\x05."}}), "memo 5 read before written"},
      {"string past the end",
       zip_of({{"archive/data.pkl",
                "\x80\x02X\xf0\xff\xff\xff"
                "ab."}}),
       "truncated"},
      {"integer wider than 64 bits", zip_of({{"archive/data.pkl", "\x80\x02\x8a\x09" + std::string(9, '\1') + "."}}),
       "exceeds 64 bits"},
      {"unknown class",
       zip_of({{"archive/data.pkl",
                "\x80\x02"
                "c__main__\nNet\n)R."}}),
       "unsupported Python object '__main__.Net'"},
      {"no data.pkl", zip_of({{"archive/other", "x"}}), "no <archive>/data.pkl"},
      {"compressed entry", zip_of({{"archive/data.pkl", "\x80\x02N.", 8}}), "is compressed (method 8)"},
      {"bad CRC", bad_crc, "fails its CRC check"},
      {"central directory outside", cd_outside, "lies outside"},
      {"entry past the end", long_entry, "runs past the end"},
      {"storage shorter than the view", t({3, 2}, {2, 1}), "needs more than the 4 elements of storage '0'"},
      {"offset past the storage", t({2}, {1}, 4, 3), "needs more than the 4 elements"},
      {"storage entry shorter than its header", t({2}, {1}, 8), "holds 16 bytes, its header says 32"},
      {"negative size", t({-1}, {1}), "negative size -1"},
      {"negative stride", t({2}, {-1}), "negative stride -1"},
      {"negative offset", t({1}, {1}, 4, -2), "negative storage offset -2"},
      {"overflowing sizes", t({std::int64_t{1} << 40, std::int64_t{1} << 40}, {1, 1}), "element count overflows"},
      {"overflowing stride reach", t({3}, {INT64_MAX / 2}), "needs more than the 4 elements"},
      {"huge storage numel", t({1}, {1}, INT64_MAX), "overflowing size"},
      {"sizes and strides differ", t({2, 2}, {1}), "2 sizes but 1 strides"},
      {"unsupported dtype", t({4}, {1}, 4, 0, "CharStorage"), "has dtype int8"},
      {"unknown storage", t({4}, {1}, 4, 0, "NoSuchStorage"), "storage type 'torch.NoSuchStorage'"},
      {"missing storage entry",
       zip_of({{"archive/data.pkl", "\x80\x02}" + uni("x") + tensor_pickle("FloatStorage", 4, 0, {1}, {1}) + "s."}}),
       "no entry 'archive/data/0'"},
      {"list containing itself", zip_of({{"archive/data.pkl", self_list}}), "nested deeper than 64 levels"},
      {"exponential references", zip_of({{"archive/data.pkl", doubling}}), "exceed 16 times the file's size"},
      {"SETITEM on a list", zip_of({{"archive/data.pkl", "\x80\x02]NNs."}}), "SETITEM on a list"},
      {"tuple dict key", zip_of({{"archive/data.pkl", "\x80\x02})Ns."}}), "a dict key in 'tensor' is a tuple"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string m = bytes_error(c.bytes);
    EXPECT_EQ(m.rfind("mem.pt: ", 0), 0u) << m;
    EXPECT_NE(m.find(c.fault), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}
