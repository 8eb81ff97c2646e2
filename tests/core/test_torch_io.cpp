// .pt files written by LibTorch's own writer (the format torch.save writes) read back exactly.
#include <gtest/gtest.h>

#include <cmath>

#include "core/torch_io.h"
#include "tests/core/corrupt_safetensors.h"

using namespace twin;
using twin::testing::TempDir;

namespace {

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

}  // namespace

TEST(TorchIO, DictOfEveryDtypeRoundTrips) {
  if (!torch_io_available()) GTEST_SKIP() << "built without LibTorch";
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
  if (!torch_io_available()) GTEST_SKIP() << "built without LibTorch";
  TempDir dir;
  const std::string path = dir.file("t.pt");
  write_torch_file(path, {{"", Tensor::from_vector<float>({3}, {1, 2, 3})}});
  const TorchFile f = read_torch_file(path);
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].first, "tensor");
  EXPECT_EQ(f.tensors[0].second.at_f64(2), 3.0);
}

TEST(TorchIO, BadFilesAreOneLineErrorsNamingTheFile) {
  TempDir dir;
  const std::string missing = dir.file("missing.pt");
  std::string m = torch_error(missing);
  EXPECT_EQ(m.rfind(missing + ": ", 0), 0u) << m;
  if (!torch_io_available()) {
    EXPECT_NE(m.find("unsupported"), std::string::npos) << m;
    return;
  }
  const std::string legacy = dir.file("legacy.pt");
  twin::testing::write_bytes(legacy, std::string("\x80\x02\x8a\x0a", 4) + std::string(40, 'x'));
  m = torch_error(legacy);
  EXPECT_NE(m.find("not a torch.save zip archive"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;

  const std::string broken = dir.file("broken.pt");
  twin::testing::write_bytes(broken, std::string("PK\x03\x04", 4) + std::string(100, '\0'));
  m = torch_error(broken);
  EXPECT_EQ(m.rfind(broken + ": LibTorch cannot read it", 0), 0u) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;

  // A real archive cut short.
  const std::string good = dir.file("good.pt");
  write_torch_file(good, every_dtype());
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = dir.file("cut.pt");
  twin::testing::write_bytes(cut, bytes.substr(0, bytes.size() / 2));
  m = torch_error(cut);
  EXPECT_EQ(m.rfind(cut + ": ", 0), 0u) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}
