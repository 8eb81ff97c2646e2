// Fuzzes the .pt reader (a zip reader plus a pickle machine, core/torch_io_read.cpp): .pt files
// are dumps from training runs that anyone can hand to `twin inspect`, and both layers are full of
// offsets, lengths and counts. The contract (core/torch_io.h): malformed or hostile bytes are a
// TorchFileError, never a crash, hang or an allocation beyond 16 times the input plus 64 MiB; a
// successful read yields tensors whose values can all be read.
//
// Two kinds of input, told apart by their first bytes:
// - "PK...": a whole .pt file (the seeds torch.save wrote), so the zip layer is fuzzed;
// - anything else: the bytes of data.pkl, which this target wraps in a valid zip (CRCs right,
//   storages "0".."7" of 256 bytes each) so that mutations reach the pickle machine instead of
//   failing the zip CRC check.
#include <zlib.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/torch_io.h"
#include "fuzz/fuzz_common.h"

namespace {

void put16(std::vector<std::uint8_t>& out, std::uint32_t v) {
  out.push_back(v & 0xFF);
  out.push_back((v >> 8) & 0xFF);
}
void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  put16(out, v & 0xFFFF);
  put16(out, v >> 16);
}

// A zip of stored entries, as torch.save writes them (no data descriptors, no zip64).
std::vector<std::uint8_t> stored_zip(const std::vector<std::pair<std::string, std::vector<std::uint8_t>>>& entries) {
  std::vector<std::uint8_t> out, dir;
  for (const auto& [name, bytes] : entries) {
    const std::uint32_t crc = static_cast<std::uint32_t>(::crc32(0L, bytes.data(), static_cast<uInt>(bytes.size()))),
                        local = static_cast<std::uint32_t>(out.size());
    const auto n = static_cast<std::uint32_t>(bytes.size());
    put32(out, 0x04034b50u);
    put16(out, 20);
    put16(out, 0);
    put16(out, 0);
    put32(out, 0);
    put32(out, crc);
    put32(out, n);
    put32(out, n);
    put16(out, name.size());
    put16(out, 0);
    out.insert(out.end(), name.begin(), name.end());
    out.insert(out.end(), bytes.begin(), bytes.end());
    put32(dir, 0x02014b50u);
    put16(dir, 20);
    put16(dir, 20);
    put16(dir, 0);
    put16(dir, 0);
    put32(dir, 0);
    put32(dir, crc);
    put32(dir, n);
    put32(dir, n);
    put16(dir, name.size());
    put16(dir, 0);
    put16(dir, 0);
    put16(dir, 0);
    put16(dir, 0);
    put32(dir, 0);
    put32(dir, local);
    dir.insert(dir.end(), name.begin(), name.end());
  }
  const auto cd_offset = static_cast<std::uint32_t>(out.size()), cd_size = static_cast<std::uint32_t>(dir.size());
  out.insert(out.end(), dir.begin(), dir.end());
  put32(out, 0x06054b50u);
  put16(out, 0);
  put16(out, 0);
  put16(out, entries.size());
  put16(out, entries.size());
  put32(out, cd_size);
  put32(out, cd_offset);
  put16(out, 0);
  return out;
}

void read_and_check(const std::uint8_t* data, std::size_t size) {
  try {
    const twin::TorchFile f = twin::read_torch_bytes("fuzz.pt", data, size);
    const std::size_t budget = 16 * size + (std::size_t(64) << 20);
    std::size_t total = 0;
    for (const auto& [name, t] : f.tensors) {
      total += t.nbytes() + name.size();
      if (t.numel() <= (1 << 14)) (void)t.to_f64();
      (void)t.describe();
    }
    for (const auto& [k, v] : f.metadata) total += k.size() + v.size();
    if (total > budget) twin::fuzz::finding("the result is larger than 16 x the input + 64 MiB");
  } catch (const twin::TorchFileError&) {
    // Documented answer to a malformed file.
  } catch (const std::exception& e) {
    twin::fuzz::unexpected_exception(e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size >= 2 && data[0] == 'P' && data[1] == 'K') {
    read_and_check(data, size);
    return 0;
  }
  std::vector<std::pair<std::string, std::vector<std::uint8_t>>> entries;
  entries.push_back({"archive/data.pkl", std::vector<std::uint8_t>(data, data + size)});
  entries.push_back({"archive/byteorder", {'l', 'i', 't', 't', 'l', 'e'}});
  for (int k = 0; k < 8; ++k) {
    std::vector<std::uint8_t> storage(256);
    for (std::size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<std::uint8_t>(i * 37 + k);
    entries.push_back({"archive/data/" + std::to_string(k), std::move(storage)});
  }
  entries.push_back({"archive/version", {'3', '\n'}});
  const std::vector<std::uint8_t> zip = stored_zip(entries);
  read_and_check(zip.data(), zip.size());
  return 0;
}
