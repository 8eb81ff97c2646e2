// Taps: the output of every submodule, recorded under the module path Megatron's fixtures use
// ("self_attention.linear_qkv.0", "mlp.router.1", "cross_attention.encoder.layers.0.0", ...),
// in the order the layer computes them, so a comparison can name the first tensor that diverges.
// Each entry carries the rounding points counted before it (core/rounding.h).
//
// A Taps value is cheap to copy: it is a prefix and a pointer to the shared record. Submodules
// get child("name") and record their outputs relative to it. A null record records nothing.
#pragma once

#include <string>
#include <utility>

#include "core/record.h"

namespace twin::reference {

using TapRecord = Record;

class Taps {
 public:
  Taps() = default;
  explicit Taps(Record* record, std::string prefix = "") : record_(record), prefix_(std::move(prefix)) {}

  bool enabled() const { return record_ != nullptr; }
  Taps child(const std::string& name) const { return Taps(record_, prefix_ + name + "."); }
  std::string path(const std::string& name) const { return prefix_ + name; }

  // A module output under prefix + name; a module called more than once gets "#n" (n = 1, 2, ...)
  // on its later calls, as the fixtures' hooks name them.
  void record(const std::string& name, const Tensor& t) const { add(Role::Tap, name, t, false); }
  // A parameter a module hands out as an output (the bias of a skip_bias_add linear): exact.
  void record_param(const std::string& name, const Tensor& t) const { add(Role::Tap, name, t, true); }
  // An input of this module (the fixtures' tap_in.<module>.<name>).
  void record_input(const std::string& name, const Tensor& t) const { add(Role::TapIn, name, t, false); }
  // An aux loss as Megatron logs it (aux.<name>: no module path) / the module's state after the
  // call (state.<module path>.<name>, compared exactly: counters).
  void record_aux(const std::string& name, const Tensor& t) const {
    if (record_) record_->add(Role::Aux, name, t);
  }
  void record_state(const std::string& name, const Tensor& t) const {
    if (record_) record_->add_exact(Role::State, prefix_ + name, t);
  }
  // The magnitude the last entry's error scales with, when not its own (see RecordEntry).
  void set_magnitude(double m) const {
    if (record_ && !record_->entries.empty()) record_->entries.back().magnitude = m;
  }

 private:
  void add(Role role, const std::string& name, const Tensor& t, bool exact) const {
    if (!record_) return;
    std::string full = prefix_ + name;
    const int n = record_->calls[role_prefix(role) + full]++;
    if (n > 0) full += "#" + std::to_string(n);
    if (exact)
      record_->add_exact(role, std::move(full), t);
    else
      record_->add(role, std::move(full), t);
  }

  Record* record_ = nullptr;
  std::string prefix_;
};

}  // namespace twin::reference
