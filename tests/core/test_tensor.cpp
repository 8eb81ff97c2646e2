// Host tensor: conversions, views, and misuse that must be a ShapeError naming both sides.
#include <gtest/gtest.h>

#include <cmath>

#include "core/tensor.h"

using namespace twin;

namespace {

// Runs f, which must throw ShapeError; returns its message.
template <class F>
std::string shape_error(F&& f) {
  try {
    f();
  } catch (const ShapeError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ShapeError";
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(Tensor, BasicsAndValues) {
  const Tensor t = Tensor::from_vector<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(t.dim(), 2);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.nbytes(), 24u);
  EXPECT_EQ(t.size(-1), 3);
  EXPECT_EQ(t.describe(), "[2, 3] F32");
  EXPECT_EQ(t.at_f64(4), 5.0);
  const auto m = t.matrix<float>(3, 2);
  EXPECT_EQ(m(2, 0), 5.0f);
  EXPECT_EQ(t.rows_view<float>().rows(), 2);
  EXPECT_EQ(t.reshape({6}).shape(), Shape({6}));
  EXPECT_EQ(Tensor::zeros(DType::I64, {4}).at_f64(3), 0.0);
}

TEST(Tensor, ConversionsRoundToNearestEven) {
  const Tensor t = Tensor::from_vector<double>({3}, {1.0 + std::ldexp(1.0, -8), 1.0 + 3 * std::ldexp(1.0, -8), -2.0});
  const Tensor b = t.to(DType::BF16);
  EXPECT_EQ(b.dtype(), DType::BF16);
  EXPECT_EQ(b.at_f64(0), 1.0);                        // tie -> even (down)
  EXPECT_EQ(b.at_f64(1), 1.0 + std::ldexp(1.0, -6));  // tie -> even (up)
  EXPECT_EQ(b.to(DType::F32).at_f64(2), -2.0);
  EXPECT_EQ(Tensor::from_vector<bool>({2}, {true, false}).to(DType::I32).at_f64(0), 1.0);
}

TEST(Tensor, CloneIsDeepAndReshapeShares) {
  Tensor a = Tensor::from_vector<float>({2}, {1, 2});
  Tensor c = a.clone();
  Tensor r = a.reshape({2, 1});
  a.data_mut<float>()[0] = 7;
  EXPECT_EQ(c.at_f64(0), 1.0);
  EXPECT_EQ(r.at_f64(0), 7.0);
}

TEST(Tensor, WrongDtypeAccessNamesBothDtypes) {
  const Tensor t = Tensor::zeros(DType::BF16, {2, 3});
  const std::string m = shape_error([&] { t.data<float>(); });
  EXPECT_TRUE(has(m, "BF16") && has(m, "F32") && has(m, "[2, 3]")) << m;
  EXPECT_THROW(Tensor().data<float>(), ShapeError);
}

TEST(Tensor, ReshapeMismatchNamesBothShapes) {
  const Tensor t = Tensor::zeros(DType::F32, {2, 3});
  const std::string m = shape_error([&] { t.reshape({4, 2}); });
  EXPECT_TRUE(has(m, "[2, 3]") && has(m, "[4, 2]")) << m;
}

TEST(Tensor, ExpectNamesBothShapesAndDtypes) {
  const Tensor t = Tensor::zeros(DType::F32, {16, 2, 64});
  const std::string s = shape_error([&] { t.expect({16, 2, 32}, "hidden_states"); });
  EXPECT_TRUE(has(s, "hidden_states") && has(s, "[16, 2, 32]") && has(s, "[16, 2, 64]")) << s;
  const std::string d = shape_error([&] { t.expect({16, 2, 64}, DType::BF16, "hidden_states"); });
  EXPECT_TRUE(has(d, "BF16") && has(d, "F32")) << d;
  EXPECT_NO_THROW(t.expect({16, 2, 64}, DType::F32, "hidden_states"));
  EXPECT_TRUE(has(shape_error([&] { Tensor().expect({1}, "x"); }), "no tensor"));
}

TEST(Tensor, BadViewsAndIndicesAreErrors) {
  const Tensor t = Tensor::zeros(DType::F32, {2, 3});
  const std::string m = shape_error([&] { t.matrix<float>(4, 2); });
  EXPECT_TRUE(has(m, "4x2") && has(m, "[2, 3]")) << m;
  EXPECT_THROW(t.matrix<double>(2, 3), ShapeError);
  EXPECT_THROW(t.size(2), ShapeError);
  EXPECT_THROW(t.size(-3), ShapeError);
  EXPECT_THROW(t.at_f64(6), ShapeError);
  EXPECT_THROW(t.at_f64(-1), ShapeError);
  EXPECT_THROW(Tensor::from_vector<float>({2, 2}, {1, 2, 3}), ShapeError);
  EXPECT_THROW(Tensor::from_doubles(DType::F16, {3}, {1, 2}), ShapeError);
  EXPECT_THROW(Tensor::zeros(DType::F32, {2, -1}), ShapeError);
}

TEST(Tensor, BorrowedStorageIsCopiedOnWrite) {
  const float src[2] = {1, 2};
  Tensor t = Tensor::borrow(DType::F32, {2}, nullptr, src);
  EXPECT_TRUE(t.is_borrowed());
  t.data_mut<float>()[1] = 5;
  EXPECT_FALSE(t.is_borrowed());
  EXPECT_EQ(src[1], 2.0f);
  EXPECT_EQ(t.at_f64(1), 5.0);
}

TEST(Tensor, RangesReadAndWriteAsDoubles) {
  Tensor t = Tensor::from_vector<double>({2, 3}, {0, 0, 0, 0, 0, 0}).to(DType::BF16);
  const double in[2] = {1.0 + 3 * std::ldexp(1.0, -8), -3.0};
  t.write_f64(2, 2, in);  // elements 2 and 3 only, rounded to nearest even as to() does
  double out[4] = {9, 9, 9, 9};
  t.read_f64(1, 4, out);
  EXPECT_EQ(out[0], 0.0);
  EXPECT_EQ(out[1], 1.0 + std::ldexp(1.0, -6));
  EXPECT_EQ(out[2], -3.0);
  EXPECT_EQ(out[3], 0.0);
  EXPECT_TRUE(has(shape_error([&] { t.read_f64(5, 2, out); }), "elements [5, 7) out of range for [2, 3] BF16"));
  EXPECT_THROW(t.write_f64(-1, 1, in), ShapeError);

  const float src[2] = {1, 2};
  Tensor b = Tensor::borrow(DType::F32, {2}, nullptr, src);
  b.write_f64(1, 1, in + 1);  // a borrowed tensor is copied, its source left alone
  EXPECT_EQ(src[1], 2.0f);
  EXPECT_EQ(b.at_f64(1), -3.0);
}
