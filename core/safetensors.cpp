#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

namespace twin {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& fault) {
  std::string one_line = fault;
  std::replace(one_line.begin(), one_line.end(), '\n', ' ');
  throw SafetensorsError(path + ": " + one_line);
}

// Owns a read-only private mapping of a whole file.
struct Mapping {
  void* addr = nullptr;
  std::size_t size = 0;
  ~Mapping() {
    if (addr && size) munmap(addr, size);
  }
};

}  // namespace

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, "no tensor named '" + name + "'");
  return it->second;
}

std::string SafetensorsFile::meta(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) fail(path_, "no __metadata__ entry '" + key + "'");
  return it->second;
}

SafetensorsFile read_safetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<std::size_t>(st.st_size);
  if (map->size > 0) {
    map->addr = mmap(nullptr, map->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map->addr == MAP_FAILED) {
      map->addr = nullptr;
      ::close(fd);
      fail(path, std::string("cannot map: ") + std::strerror(errno));
    }
  }
  ::close(fd);
  return read_safetensors_bytes(path, map, map->addr, map->size);
}

SafetensorsFile read_safetensors_bytes(const std::string& name, const void* data, std::size_t size) {
  auto copy = std::shared_ptr<unsigned char[]>(new unsigned char[std::max<std::size_t>(size, 1)]);
  if (size) std::memcpy(copy.get(), data, size);
  return read_safetensors_bytes(name, std::shared_ptr<const void>(copy, copy.get()), copy.get(), size);
}

SafetensorsFile read_safetensors_bytes(const std::string& path, std::shared_ptr<const void> holder, const void* data,
                                       std::size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);

  if (size < 8) fail(path, "truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kSafetensorsMaxHeader)
    fail(path, "header length " + std::to_string(n) + " is absurdly large (limit " +
                   std::to_string(kSafetensorsMaxHeader) + ")");
  if (n > size - 8)
    fail(path,
         "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");

  // nlohmann's json object is a std::map: a duplicate key would silently keep one value, so the
  // top-level keys are collected by a parser callback and checked for repeats.
  std::vector<std::string> keys;
  json::parser_callback_t collect_keys = [&keys](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1) keys.push_back(parsed.get<std::string>());
    return true;
  };
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(bytes) + 8, reinterpret_cast<const char*>(bytes) + 8 + n,
                         collect_keys);
  } catch (const json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  std::sort(keys.begin(), keys.end());
  if (auto dup = std::adjacent_find(keys.begin(), keys.end()); dup != keys.end())
    fail(path, "duplicate tensor name '" + *dup + "'");
  if (!header.is_object()) fail(path, std::string("header is not a JSON object but ") + header.type_name());

  SafetensorsFile f;
  f.path_ = path;
  f.file_size_ = size;
  const std::uint64_t data_begin = 8 + n;
  const std::uint64_t data_size = size - data_begin;

  struct Entry {
    std::string name;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "__metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) fail(path, "__metadata__ value '" + k + "' is not a string");
        f.metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      fail(path, "tensor '" + name + "' lacks dtype, shape or data_offsets");
    if (!v["dtype"].is_string()) fail(path, "tensor '" + name + "': dtype is not a string");
    const auto dt = dtype_from_name(v["dtype"].get<std::string>());
    if (!dt) fail(path, "tensor '" + name + "': unknown dtype '" + v["dtype"].get<std::string>() + "'");
    Shape shape;
    if (!v["shape"].is_array()) fail(path, "tensor '" + name + "': shape is not a list");
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned())
        fail(path, "tensor '" + name + "': shape " + v["shape"].dump() + " has a non-natural entry");
      // Tensor counts in int64: a dimension past INT64_MAX would turn negative.
      if (d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail(path, "tensor '" + name + "': shape " + v["shape"].dump() + " has an entry beyond int64");
      shape.push_back(d.get<std::int64_t>());
    }
    // The product of the nonzero dimensions (so every partial product of the shape) must fit in
    // int64: a zero dimension makes the byte count checked below 0 whatever the other dimensions
    // are, so without this [2^62, 2^62, 0] would pass and overflow where the elements are counted.
    std::int64_t count = 1;
    for (auto d : shape)
      if (d != 0 && __builtin_mul_overflow(count, d, &count))
        fail(path, "tensor '" + name + "': shape " + shape_str(shape) + " has more elements than int64 can count");
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, "tensor '" + name + "': data_offsets " + off.dump() + " is not [begin, end]");
    const auto b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
    if (b > e || e > data_size)
      fail(path, "tensor '" + name + "': data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                     "] out of range (data section has " + std::to_string(data_size) + " bytes)");
    // Guard the product against overflow before comparing.
    long double want = dtype_size(*dt);
    for (auto d : shape) want *= static_cast<long double>(d);
    if (want != static_cast<long double>(e - b))
      fail(path, "tensor '" + name + "': data_offsets span " + std::to_string(e - b) + " bytes but shape " +
                     shape_str(shape) + " x " + dtype_name(*dt) + " needs " +
                     // Converting a long double past 2^64 to an integer is undefined: say so instead.
                     (want < 18446744073709551616.0L ? std::to_string(static_cast<unsigned long long>(want))
                                                     : std::string("over 2^64")));
    entries.push_back({name, b, e});
    const unsigned char* at = bytes + data_begin + b;
    if (reinterpret_cast<std::uintptr_t>(at) % dtype_size(*dt) == 0) {
      f.tensors_[name] = Tensor::borrow(*dt, shape, holder, at);
    } else {
      // Other writers need not align the data section: copy rather than load misaligned values.
      Tensor owned = Tensor::empty(*dt, shape);
      if (owned.nbytes()) std::memcpy(owned.raw_mut(), at, owned.nbytes());
      f.tensors_[name] = std::move(owned);
    }
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
  for (std::size_t i = 1; i < entries.size(); ++i)
    if (entries[i].begin < entries[i - 1].end)
      fail(path, "tensors '" + entries[i - 1].name + "' and '" + entries[i].name + "' overlap in the data section");
  for (const auto& e : entries) f.names_.push_back(e.name);
  return f;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw SafetensorsError(path + ": '__metadata__' cannot name a tensor");
    if (header.contains(name)) throw SafetensorsError(path + ": duplicate tensor name '" + name + "'");
    header[name] = {
        {"dtype", dtype_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data section starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw SafetensorsError(path + ": cannot open for writing: " + std::strerror(errno));
  const std::uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, t] : tensors)
    if (t.nbytes()) out.write(reinterpret_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) throw SafetensorsError(path + ": write failed");
}

}  // namespace twin
