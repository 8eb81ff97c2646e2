// The LibTorch side of core/torch_io.h (writing; reading is core/torch_io_read.cpp), built as a
// plugin (libtwin_torchio_plugin.so) that core/torch_io_loader.cpp loads on the first write:
// LibTorch pulls in some 270 shared libraries, and the `twin` tool should not pay for them on
// every start. This is the only translation unit that includes LibTorch headers.
#include "core/torch_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace twin {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& fault) {
  std::string line = fault;
  std::replace(line.begin(), line.end(), '\n', ' ');
  throw TorchFileError(path + ": " + line);
}

at::ScalarType to_torch(DType dt) {
  switch (dt) {
    case DType::F64:
      return at::kDouble;
    case DType::F32:
      return at::kFloat;
    case DType::BF16:
      return at::kBFloat16;
    case DType::F16:
      return at::kHalf;
    case DType::I64:
      return at::kLong;
    case DType::I32:
      return at::kInt;
    case DType::BOOL:
      return at::kBool;
  }
  return at::kFloat;
}

}  // namespace

void write_torch_file_impl(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  const auto to_at = [](const Tensor& t) {
    std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
    return at::from_blob(const_cast<std::byte*>(t.raw()), sizes, at::TensorOptions().dtype(to_torch(t.dtype())))
        .clone();
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
extern "C" int twin_torchio_write_v1(const std::string* path,
                                     const std::vector<std::pair<std::string, twin::Tensor>>* tensors,
                                     std::string* error) {
  try {
    twin::write_torch_file_impl(*path, *tensors);
    return 0;
  } catch (const std::exception& e) {
    *error = e.what();
    return 1;
  }
}
