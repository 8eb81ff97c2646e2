// Taps: the output of every submodule, recorded under the module path Megatron's fixtures use
// ("self_attention.linear_qkv.0", "mlp.router.1", "cross_attention.encoder.layers.0.0", ...),
// in the order the layer computes them, so a comparison can name the first tensor that diverges.
// Each entry carries the rounding points counted before it (core/rounding.h).
//
// A Taps value is cheap to copy: it is a prefix and pointers to the shared record and to an
// optional source of substitutes. Submodules get child("name") and record their outputs relative
// to it. A null record records nothing.
//
// Isolation: every record call returns the value the computation continues with. Without
// substitutes that is the recorded value itself. With a source of substitutes (a lookup by record
// key, "tap.mlp.linear_fc1.0" -> tensor, handed in by whoever runs the twin), a tap the source has
// is recorded as the twin computed it and the computation continues with the substitute: each
// module then runs on a given input, so its recorded output shows the error it introduces, not the
// error it inherits. The running rounding count is reset to what the substitute carries, one store
// in its dtype, so the next module's bound counts only its own rounding points plus that store. A
// substitute of another shape, or integer where the twin's value is floating (or back), is not
// used: the comparison of that tap reports the mismatch. Parameters handed out as outputs, aux
// losses and state are never substituted (nothing computed them from an input).
//
//   x = taps.record("input_layernorm", x, {s, b, h}, precision);   // x, or the substitute
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "core/record.h"
#include "reference/precision.h"

namespace twin::reference {

using TapRecord = Record;

// A lookup of substitutes by record key; null (or an empty function): none.
using Substitutes = std::function<const Tensor*(const std::string& key)>;

class Taps {
 public:
  Taps() = default;
  explicit Taps(Record* record, std::string prefix = "", const Substitutes* substitutes = nullptr)
      : record_(record), prefix_(std::move(prefix)), substitutes_(substitutes) {}

  bool enabled() const { return record_ != nullptr; }
  Taps child(const std::string& name) const { return Taps(record_, prefix_ + name + ".", substitutes_); }
  std::string path(const std::string& name) const { return prefix_ + name; }

  // A module output under prefix + name; a module called more than once gets "#n" (n = 1, 2, ...)
  // on its later calls, as the fixtures' hooks name them. Returns the value to continue with.
  Tensor record(const std::string& name, const Tensor& t) const {
    const Tensor* s = add(Role::Tap, name, t, false);
    return s ? *s : t;
  }
  // The same for a matrix holding a tensor of `shape` stored in `dtype` (the storage dtype of a
  // Precision, or a router dtype); the tensor is only built when recording.
  Mat record(const std::string& name, const Mat& m, Shape shape, DType dtype) const;
  Mat record(const std::string& name, const Mat& m, Shape shape, const Precision& p) const {
    return record(name, m, std::move(shape), p.storage_dtype());
  }
  // A parameter a module hands out as an output (the bias of a skip_bias_add linear): exact.
  void record_param(const std::string& name, const Tensor& t) const { add(Role::Tap, name, t, true); }
  // An input of this module (the fixtures' tap_in.<module>.<name>). Returns the value to continue with.
  Tensor record_input(const std::string& name, const Tensor& t) const {
    const Tensor* s = add(Role::TapIn, name, t, false);
    return s ? *s : t;
  }
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
  // The same per block of its last dim (RecordEntry::block_magnitude).
  void set_block_magnitude(Tensor m) const {
    if (record_ && !record_->entries.empty()) record_->entries.back().block_magnitude = std::move(m);
  }

 private:
  // Records t; returns the substitute to continue with, or null (continue with t).
  const Tensor* add(Role role, const std::string& name, const Tensor& t, bool exact) const;

  Record* record_ = nullptr;
  std::string prefix_;
  const Substitutes* substitutes_ = nullptr;
};

}  // namespace twin::reference
