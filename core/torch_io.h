// PyTorch files: reads what `torch.save` writes (the zip format of PyTorch >= 1.6) holding
// tensors in any containers torch.save pickles around them (dicts, OrderedDicts, nested dicts,
// lists, tuples; views and tensors sharing a storage), so dumps from real training runs can be
// inspected and compared. Writes the same format with LibTorch's own writer.
//
// Reading needs no LibTorch: core/torch_io_read.cpp is a small zip reader and the subset of
// Python's pickle machine that torch.save emits (LibTorch 1.13's own unpickler rejects ordinary
// torch.save files, a one-entry dict among them). Writing goes through LibTorch: core/torch_io.cpp
// is a plugin loaded on the first write (core/torch_io_loader.cpp), so tools that never write a
// .pt file never load its ~270 shared libraries. Without LibTorch (or without the plugin)
// write_torch_file throws TorchFileError saying writing .pt is unsupported.
#pragma once

#include <cstddef>
#include <cstdint>
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

// True when write_torch_file works (the LibTorch plugin loads). Reading never needs it.
bool torch_write_available();
// The former name of torch_write_available, from when reading needed LibTorch too.
bool torch_io_available();

struct TorchFile {
  std::string path;
  std::vector<std::pair<std::string, Tensor>> tensors;  // in the file's order; a bare tensor is named "tensor"
  std::map<std::string, std::string>
      metadata;  // non-tensor leaves as Python prints them: 3, 1.5, True, None, text, torch.float32
};

// Nested containers are flattened with dotted names ("model.layers.0.weight", list and tuple
// items by index); a view is copied out of its storage (offset and strides honoured) into a
// contiguous tensor. Dtypes: F64, F32, BF16, F16, I64, I32, BOOL; any other is an error naming
// the tensor. Anything that is not a tensor, container, number, string, None or a torch global
// (such as torch.float32) is an error: twin does not run Python objects.
TorchFile read_torch_file(const std::string& path);

// The same from bytes in memory (`name` prefixes the messages). Every offset, length and count
// is checked: malformed or hostile input is a TorchFileError, never a crash or a hang, and
// memory stays in proportion to `size` (the pickle machine about 64 bytes per byte of data.pkl,
// the flattened result at most 16 times `size` plus 64 MiB).
TorchFile read_torch_bytes(const std::string& name, const std::uint8_t* data, std::size_t size);

// Writes with torch::jit::pickle_save (the format torch.save writes and torch.load reads): a bare
// tensor when `tensors` holds one entry named "", else a dict name -> tensor.
void write_torch_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors);

}  // namespace twin
