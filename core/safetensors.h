// safetensors reader and writer (https://github.com/huggingface/safetensors format):
//   [u64 little-endian N][N bytes of JSON header][raw little-endian data]
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the end of the header) plus an optional "__metadata__" string->string map.
//
// Files are memory-mapped, never copied: tensors borrow the mapping and keep it alive.
// Every malformed file raises SafetensorsError whose what() is one line "<path>: <fault>".
// read_safetensors_bytes parses an image already in memory with the same checks (the file reader
// is a mapping plus that parse), so the parser can be tested and fuzzed without files.
#pragma once

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace twin {

struct SafetensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class SafetensorsFile {
 public:
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Names in storage order (ascending data offset).
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws SafetensorsError "<path>: no tensor named '<name>'".
  const Tensor& at(const std::string& name) const;
  std::string meta(const std::string& key) const;  // throws when the key is missing
  std::size_t file_size() const { return file_size_; }

  friend SafetensorsFile read_safetensors_bytes(const std::string& name, std::shared_ptr<const void> holder,
                                                const void* data, std::size_t size);

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::string> names_;
  std::map<std::string, Tensor> tensors_;
  std::size_t file_size_ = 0;
};

SafetensorsFile read_safetensors(const std::string& path);

// Parses the `size` bytes at `data` as a safetensors file; `name` stands in for the path (in
// path() and in messages). Tensors borrow `data`; `holder` keeps it alive (may be null when the
// caller keeps `data` alive longer than the result).
SafetensorsFile read_safetensors_bytes(const std::string& name, std::shared_ptr<const void> holder, const void* data,
                                       std::size_t size);
// Copies the bytes first: the result does not refer to `data`.
SafetensorsFile read_safetensors_bytes(const std::string& name, const void* data, std::size_t size);

// Writes tensors in the given order, 8-byte aligned header as the reference writer does.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The header limit: real files have headers of kilobytes; 100 MB is the reference limit.
constexpr std::uint64_t kSafetensorsMaxHeader = 100'000'000;

}  // namespace twin
