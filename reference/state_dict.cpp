#include "reference/state_dict.h"

namespace twin::reference {

const Tensor& StateDict::get(const std::string& key, const Shape& shape) const {
  auto it = tensors_.find(key);
  if (it == tensors_.end()) throw ShapeError("param " + key + ": missing (expected shape " + shape_str(shape) + ")");
  if (it->second.shape() != shape)
    throw ShapeError("param " + key + ": expected shape " + shape_str(shape) + ", got " +
                     shape_str(it->second.shape()));
  if (!is_floating(it->second.dtype()))
    throw ShapeError("param " + key + ": expected a floating dtype, got " + it->second.describe());
  used_.insert(key);
  return it->second;
}

Mat StateDict::matrix(const std::string& key, std::int64_t rows, std::int64_t cols) const {
  return to_mat(get(key, {rows, cols}), rows, cols, "param " + key);
}

RowVec StateDict::vector(const std::string& key, std::int64_t n) const {
  return to_rowvec(get(key, {n}), "param " + key);
}

std::vector<std::string> StateDict::unused_keys() const {
  std::vector<std::string> out;
  for (const auto& [k, t] : tensors_)
    if (!used_.count(k)) out.push_back(k);
  return out;
}

void StateDict::expect_all_used(const std::string& what) const {
  const auto unused = unused_keys();
  if (unused.empty()) return;
  std::string list;
  for (const auto& k : unused) list += (list.empty() ? "" : ", ") + k;
  throw ShapeError(what + ": unexpected parameters not owned by the spec: " + list);
}

}  // namespace twin::reference
