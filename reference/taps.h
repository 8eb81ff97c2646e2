// Taps: the output of every submodule, recorded under the module path Megatron's fixtures use
// ("self_attention.linear_qkv.0", "mlp.router.1", "cross_attention.encoder.layers.0.0", ...),
// in the order the layer computes them, so a comparison can name the first tensor that diverges.
//
// A Taps value is cheap to copy: it is a prefix and a pointer to the shared record. Submodules
// get child("name") and record their outputs relative to it. A null record records nothing.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace twin::reference {

struct TapRecord {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in computation order
  std::map<std::string, int> calls;                     // how often each path was recorded

  const Tensor* find(const std::string& name) const {
    for (const auto& [n, t] : tensors)
      if (n == name) return &t;
    return nullptr;
  }
};

class Taps {
 public:
  Taps() = default;
  explicit Taps(TapRecord* record, std::string prefix = "") : record_(record), prefix_(std::move(prefix)) {}

  bool enabled() const { return record_ != nullptr; }
  Taps child(const std::string& name) const { return Taps(record_, prefix_ + name + "."); }
  std::string path(const std::string& name) const { return prefix_ + name; }

  // Records under prefix + name; a module called more than once gets "#n" (n = 1, 2, ...) on
  // its later calls, as the fixtures' hooks name them.
  void record(const std::string& name, const Tensor& t) const {
    if (!record_) return;
    std::string full = prefix_ + name;
    const int n = record_->calls[full]++;
    if (n > 0) full += "#" + std::to_string(n);
    record_->tensors.emplace_back(std::move(full), t);
  }

 private:
  TapRecord* record_ = nullptr;
  std::string prefix_;
};

}  // namespace twin::reference
