// Test helpers: a temporary directory, and one corrupt safetensors file per fault the reader must
// report (used by the reader's own tests and by the `twin` command-line tests).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace twin::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "twin-test-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

inline std::string u64_le(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// [u64 header length][header][data]; `length` overrides the header length field.
inline std::string safetensors_bytes(const std::string& header, std::size_t data_bytes,
                                     std::uint64_t length = UINT64_MAX) {
  return u64_le(length == UINT64_MAX ? header.size() : length) + header + std::string(data_bytes, '\x01');
}

struct CorruptCase {
  std::string name;  // also the file name stem
  std::string bytes;
  std::string fault;  // a phrase the one-line message must contain
};

// One case per fault of the format. The data bytes are 0x01 (finite floats, valid bools).
inline std::vector<CorruptCase> corrupt_safetensors_cases() {
  const std::string one = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  const std::string valid = safetensors_bytes(one, 16);
  return {
      {"empty_file", "", "truncated"},
      {"truncated_length", valid.substr(0, 5), "truncated"},
      {"truncated_data", valid.substr(0, valid.size() - 3), "out of range"},
      {"header_past_end", safetensors_bytes(one, 16, 4096), "past the end"},
      {"header_absurd", safetensors_bytes(one, 16, std::uint64_t(1) << 62), "absurdly large"},
      {"invalid_json", safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2, )", 16), "not valid JSON"},
      {"not_an_object", safetensors_bytes("[1, 2, 3]", 0), "not a JSON object"},
      {"unknown_dtype", safetensors_bytes(R"({"a":{"dtype":"Q7","shape":[2,2],"data_offsets":[0,16]}})", 16),
       "unknown dtype 'Q7'"},
      {"offsets_out_of_range", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,4000]}})", 16),
       "out of range"},
      {"offsets_reversed", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 16),
       "out of range"},
      {"overlapping",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                         24),
       "overlap"},
      {"size_mismatch", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16),
       "needs 24"},
      {"duplicate_names",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                         16),
       "duplicate tensor name 'a'"},
      {"missing_fields", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2,2]}})", 16),
       "lacks dtype, shape or data_offsets"},
      {"negative_dim", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", 16),
       "non-natural"},
      // Found by fuzz/fuzz_safetensors.cpp: a dimension past INT64_MAX turned negative (an
      // undocumented ShapeError), a zero dimension let an int64-overflowing shape through (signed
      // overflow counting its elements), and a byte count past 2^64 was converted to an integer.
      {"dim_beyond_int64",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[18446744073709551615,0],"data_offsets":[0,0]}})", 0),
       "beyond int64"},
      {"elements_beyond_int64",
       safetensors_bytes(
           R"({"a":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}})", 0),
       "more elements than int64"},
      {"bytes_beyond_2_64",
       safetensors_bytes(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
       "needs over 2^64"},
      {"metadata_not_strings", safetensors_bytes(R"({"__metadata__":{"k":3}})", 0), "is not a string"},
  };
}

}  // namespace twin::testing
