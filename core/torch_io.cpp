// The LibTorch side of core/torch_io.h, built as a plugin (libtwin_torchio_plugin.so) that
// core/torch_io_loader.cpp loads on the first .pt file: LibTorch pulls in some 270 shared
// libraries, and the `twin` tool should not pay for them on every start. This is the only
// translation unit that includes LibTorch headers.
#include "core/torch_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace twin {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& fault) {
  std::string line = fault;
  std::replace(line.begin(), line.end(), '\n', ' ');
  throw TorchFileError(path + ": " + line);
}

// c10 messages carry a backtrace after the first line; keep the message only.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::optional<DType> from_torch(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::F64;
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kLong: return DType::I64;
    case at::kInt: return DType::I32;
    case at::kBool: return DType::BOOL;
    default: return std::nullopt;
  }
}

at::ScalarType to_torch(DType dt) {
  switch (dt) {
    case DType::F64: return at::kDouble;
    case DType::F32: return at::kFloat;
    case DType::BF16: return at::kBFloat16;
    case DType::F16: return at::kHalf;
    case DType::I64: return at::kLong;
    case DType::I32: return at::kInt;
    case DType::BOOL: return at::kBool;
  }
  return at::kFloat;
}

Tensor to_twin(const std::string& path, const std::string& name, const at::Tensor& src) {
  const auto dt = from_torch(src.scalar_type());
  if (!dt)
    fail(path, "tensor '" + name + "' has dtype " + std::string(c10::toString(src.scalar_type())) +
                   ", which twin does not read (F64, F32, BF16, F16, I64, I32, BOOL)");
  const at::Tensor t = src.is_sparse() ? src.to_dense().contiguous() : src.contiguous();
  Tensor r = Tensor::empty(*dt, Shape(t.sizes().begin(), t.sizes().end()));
  if (r.nbytes()) std::memcpy(r.raw_mut(), t.data_ptr(), r.nbytes());
  return r;
}

void flatten(const std::string& path, const std::string& name, const c10::IValue& v, TorchFile& out) {
  const std::string key = name.empty() ? "tensor" : name;
  const auto child = [&](const std::string& k) { return name.empty() ? k : name + "." + k; };
  if (v.isTensor()) {
    out.tensors.emplace_back(key, to_twin(path, key, v.toTensor()));
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      const c10::IValue& k = kv.key();
      const std::string ks = k.isString() ? k.toStringRef() : k.isInt() ? std::to_string(k.toInt()) : "?";
      flatten(path, child(ks), kv.value(), out);
    }
  } else if (v.isList()) {
    const auto list = v.toListRef();
    for (std::size_t i = 0; i < list.size(); ++i) flatten(path, child(std::to_string(i)), list[i], out);
  } else if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    for (std::size_t i = 0; i < elems.size(); ++i) flatten(path, child(std::to_string(i)), elems[i], out);
  } else if (v.isNone()) {
    out.metadata[key] = "None";
  } else if (v.isString()) {
    out.metadata[key] = v.toStringRef();
  } else if (v.isInt() || v.isDouble() || v.isBool()) {
    std::ostringstream s;
    s << v;
    out.metadata[key] = s.str();
  } else {
    fail(path, "'" + key + "' holds a " + v.tagKind() + ", not a tensor, dict, list or number");
  }
}

}  // namespace

TorchFile read_torch_file_impl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "PK\x03\x04", 4) != 0)
    fail(path, "not a torch.save zip archive (legacy pre-1.6 or non-PyTorch file); re-save it with torch.save");
  c10::IValue v;
  try {
    v = torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    fail(path, "LibTorch cannot read it: " + first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    fail(path, "LibTorch cannot read it: " + first_line(e.what()));
  }
  TorchFile f;
  f.path = path;
  flatten(path, "", v, f);
  return f;
}

void write_torch_file_impl(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  const auto to_at = [](const Tensor& t) {
    std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
    return at::from_blob(const_cast<std::byte*>(t.raw()), sizes, at::TensorOptions().dtype(to_torch(t.dtype()))).clone();
  };
  c10::IValue v;
  if (tensors.size() == 1 && tensors[0].first.empty()) {
    v = to_at(tensors[0].second);
  } else {
    c10::Dict<std::string, at::Tensor> d;
    for (const auto& [name, t] : tensors) {
      if (d.contains(name)) fail(path, "duplicate tensor name '" + name + "'");
      d.insert(name, to_at(t));
    }
    v = d;
  }
  const std::vector<char> bytes = torch::jit::pickle_save(v);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) fail(path, "write failed");
}



}  // namespace twin

// Entry points looked up by the loader; errors come back as text, never as exceptions across the
// library boundary.
extern "C" int twin_torchio_read_v1(const std::string* path, twin::TorchFile* out, std::string* error) {
  try {
    *out = twin::read_torch_file_impl(*path);
    return 0;
  } catch (const std::exception& e) {
    *error = e.what();
    return 1;
  }
}

extern "C" int twin_torchio_write_v1(const std::string* path, const std::vector<std::pair<std::string, twin::Tensor>>* tensors,
                                     std::string* error) {
  try {
    twin::write_torch_file_impl(*path, *tensors);
    return 0;
  } catch (const std::exception& e) {
    *error = e.what();
    return 1;
  }
}
