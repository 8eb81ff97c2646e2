// Parameters by Megatron's state_dict keys ("self_attention.linear_qkv.weight", ...).
//
// A module loads its parameters from a StateDict under its prefix; every read checks the shape
// the config implies and names the key, the expected and the actual shape. Keys are marked as
// used so a layer can reject a state dict that holds parameters its spec does not own (torch's
// strict load_state_dict).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "reference/precision.h"

namespace twin::reference {

class StateDict {
 public:
  StateDict() = default;
  explicit StateDict(std::map<std::string, Tensor> tensors) : tensors_(std::move(tensors)) {}

  void set(const std::string& key, Tensor t) { tensors_[key] = std::move(t); }
  bool has(const std::string& key) const { return tensors_.count(key) != 0; }
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }

  // The tensor under `key`, checked against `shape`; marks it used.
  // Throws ShapeError "param <key>: expected shape [..], got [..]" or "param <key>: missing".
  const Tensor& get(const std::string& key, const Shape& shape) const;
  Mat matrix(const std::string& key, std::int64_t rows, std::int64_t cols) const;  // [rows, cols]
  RowVec vector(const std::string& key, std::int64_t n) const;                     // [n]

  std::vector<std::string> unused_keys() const;
  // Throws ShapeError listing keys nobody loaded (`what` names the loader).
  void expect_all_used(const std::string& what) const;

 private:
  std::map<std::string, Tensor> tensors_;
  mutable std::set<std::string> used_;
};

}  // namespace twin::reference
