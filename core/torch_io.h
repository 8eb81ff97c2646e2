// PyTorch files: reads what `torch.save` writes (the zip format of PyTorch >= 1.6) holding a
// tensor or a dict of tensors (nested dicts, lists and tuples are flattened with dotted names),
// so dumps from real training runs can be inspected and compared. Writes the same format with
// LibTorch's own writer.
//
// core/torch_io.cpp is the only translation unit that includes LibTorch headers (they are slow
// to compile). It is a plugin loaded on the first .pt file (core/torch_io_loader.cpp), so tools
// that never meet a .pt file never load LibTorch. Without LibTorch (or without the plugin) the
// functions throw TorchFileError saying .pt is unsupported.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace twin {

// One line: "<path>: <fault>".
struct TorchFileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool torch_io_available();

struct TorchFile {
  std::string path;
  std::vector<std::pair<std::string, Tensor>> tensors;  // in the file's order; a bare tensor is named "tensor"
  std::map<std::string, std::string> metadata;          // non-tensor leaves (numbers, strings, None), as text
};

TorchFile read_torch_file(const std::string& path);

// Writes with torch::jit::pickle_save (the format torch.save writes and torch.load reads): a bare
// tensor when `tensors` holds one entry named "", else a dict name -> tensor.
void write_torch_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors);

}  // namespace twin
