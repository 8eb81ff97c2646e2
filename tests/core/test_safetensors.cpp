#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>

#include "core/safetensors.h"
#include "tests/core/corrupt_safetensors.h"

using namespace twin;
using twin::testing::TempDir;

namespace {

// A tensor of every dtype with values that exercise the encoding (signs, NaN, Inf, extremes).
std::vector<std::pair<std::string, Tensor>> every_dtype() {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = INFINITY;
  return {
      {"f64", Tensor::from_vector<double>({2, 3}, {1.0, -2.5, 1e300, -1e-300, nan, inf})},
      {"f32", Tensor::from_vector<float>({3}, {1.5f, -3.4e38f, 1e-45f})},
      {"bf16", Tensor::from_doubles(DType::BF16, {2, 2}, {1.0, -0.333, 3e38, -inf})},
      {"f16", Tensor::from_doubles(DType::F16, {4}, {65504.0, -6e-8, 0.1, nan})},
      {"i64", Tensor::from_vector<std::int64_t>({2}, {INT64_MIN, INT64_MAX})},
      {"i32", Tensor::from_vector<std::int32_t>({3, 1}, {-7, 0, INT32_MAX})},
      {"bool", Tensor::from_vector<bool>({5}, {true, false, false, true, true})},
      {"scalar", Tensor::from_vector<float>({}, {42.0f})},
      {"empty", Tensor::zeros(DType::F32, {0, 3})},
  };
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

}  // namespace

TEST(Safetensors, RoundTripEveryDtypeAndMetadata) {
  TempDir dir;
  const auto tensors = every_dtype();
  const std::map<std::string, std::string> meta = {
      {"kind", "dense_layer"}, {"config", R"({"hidden_size": 64})"}, {"unicode", "\xce\xbb = 1e-5"}};
  const std::string path = dir.file("all.safetensors");
  write_safetensors(path, tensors, meta);
  const SafetensorsFile f = read_safetensors(path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.names().size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    // Storage order is the order written; the bytes come back identical (NaN payloads too).
    EXPECT_EQ(f.names()[i], tensors[i].first);
    const Tensor& t = f.at(tensors[i].first);
    EXPECT_TRUE(same_bytes(t, tensors[i].second)) << tensors[i].first << ": " << t.describe();
  }
}

TEST(Safetensors, TensorsBorrowTheMappingAndOutliveTheFileObject) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_safetensors(path, {{"x", Tensor::from_vector<float>({3}, {1, 2, 3})}});
  Tensor x;
  {
    const SafetensorsFile f = read_safetensors(path);
    x = f.at("x");
  }
  EXPECT_TRUE(x.is_borrowed());
  EXPECT_EQ(x.data<float>()[2], 3.0f);
  // Writing copies first: the mapped file is never modified.
  x.data_mut<float>()[0] = 9.0f;
  EXPECT_FALSE(x.is_borrowed());
  EXPECT_EQ(read_safetensors(path).at("x").data<float>()[0], 1.0f);
}

TEST(Safetensors, DataSectionIsEightByteAligned) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  write_safetensors(path, {{"x", Tensor::from_vector<double>({1}, {1.0})}}, {{"k", "odd length"}});
  const SafetensorsFile f = read_safetensors(path);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(f.at("x").raw()) % 8, 0u);
}

TEST(Safetensors, UnalignedDataFromOtherWritersIsReadCorrectly) {
  // Other writers need not pad: an F64 tensor at an odd offset must still read (copied, aligned).
  TempDir dir;
  const std::string header =
      R"({"b":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"F64","shape":[1],"data_offsets":[1,9]}})";
  std::string bytes = twin::testing::u64_le(header.size()) + header + std::string(1, '\x01');
  const double v = -1.25;
  bytes.append(reinterpret_cast<const char*>(&v), 8);
  const std::string path = dir.file("u.safetensors");
  twin::testing::write_bytes(path, bytes);
  const SafetensorsFile f = read_safetensors(path);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(f.at("x").raw()) % alignof(double), 0u);
  EXPECT_EQ(f.at("x").data<double>()[0], -1.25);
  EXPECT_EQ(f.at("b").at_f64(0), 1.0);
}

TEST(Safetensors, MissingTensorAndMetadataAreNamed) {
  TempDir dir;
  const std::string path = dir.file("n.safetensors");
  write_safetensors(path, {{"x", Tensor::zeros(DType::F32, {1})}});
  const SafetensorsFile f = read_safetensors(path);
  EXPECT_THROW(f.at("y"), SafetensorsError);
  try {
    f.meta("kind");
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'kind'"), std::string::npos);
  }
}

TEST(Safetensors, WriterRejectsDuplicateNames) {
  TempDir dir;
  const Tensor t = Tensor::zeros(DType::F32, {1});
  EXPECT_THROW(write_safetensors(dir.file("d.safetensors"), {{"x", t}, {"x", t}}), SafetensorsError);
  EXPECT_THROW(write_safetensors(dir.file("d.safetensors"), {{"__metadata__", t}}), SafetensorsError);
}

TEST(Safetensors, MissingFileIsOneLineNamingIt) {
  TempDir dir;
  const std::string path = dir.file("nope.safetensors");
  try {
    read_safetensors(path);
    FAIL();
  } catch (const SafetensorsError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(path + ": cannot open", 0), 0u) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos);
  }
}

class CorruptSafetensors : public ::testing::TestWithParam<twin::testing::CorruptCase> {};

// Every malformed file is a SafetensorsError of one line "<path>: <fault>", never a crash.
TEST_P(CorruptSafetensors, IsOneLineErrorNamingFileAndFault) {
  const auto& c = GetParam();
  TempDir dir;
  const std::string path = dir.file(c.name + ".safetensors");
  twin::testing::write_bytes(path, c.bytes);
  try {
    read_safetensors(path);
    FAIL() << c.name << ": no error";
  } catch (const SafetensorsError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(path + ": ", 0), 0u) << m;
    EXPECT_NE(m.find(c.fault), std::string::npos) << "expected '" << c.fault << "' in: " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryFault, CorruptSafetensors,
                         ::testing::ValuesIn(twin::testing::corrupt_safetensors_cases()),
                         [](const auto& info) { return info.param.name; });

// The in-memory reader (what fuzz/fuzz_safetensors.cpp drives) gives the same one-line error for
// every corrupt image, naming the given name in place of a path.
TEST_P(CorruptSafetensors, FromBytesIsTheSameOneLineError) {
  const auto& c = GetParam();
  try {
    read_safetensors_bytes("mem:" + c.name, c.bytes.data(), c.bytes.size());
    FAIL() << c.name << ": no error";
  } catch (const SafetensorsError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("mem:" + c.name + ": ", 0), 0u) << m;
    EXPECT_NE(m.find(c.fault), std::string::npos) << "expected '" << c.fault << "' in: " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST(Safetensors, FromBytesReadsWhatTheWriterWrote) {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  const auto tensors = every_dtype();
  write_safetensors(path, tensors, {{"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const SafetensorsFile f = read_safetensors_bytes("mem", bytes.data(), bytes.size());
  EXPECT_EQ(f.path(), "mem");
  EXPECT_EQ(f.file_size(), bytes.size());
  EXPECT_EQ(f.meta("k"), "v");
  ASSERT_EQ(f.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(same_bytes(f.at(name), t)) << name;
}
