// What a twin computed in one run, as one ordered record: outputs, taps (module outputs) and
// tap inputs in the order the layer computed them, aux losses and state after the run. Each
// entry carries the rounding points executed before it (core/rounding.h), from which parity/
// derives its bound. The twins fill a Record and know nothing of golden files; parity/ compares
// a Record against a golden by entry key ("tap.self_attention.linear_qkv.0", "aux.z_loss", ...).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/rounding.h"
#include "core/tensor.h"

namespace twin {

// The golden-file prefix of each kind of entry; Column: a column of a JSON table golden. Input and
// Param: a layer's given tensors (input.*, param.*), which a twin does not compute; a comparison of
// two captures of one layer checks them too (parity/capture_diff.h). Grad: a gradient from the
// backward, named as the golden names it without "grad." ("input.hidden_states", "param.<key>").
enum class Role { Output, Tap, TapIn, Aux, State, Column, Input, Param, Grad };
// "output." | "tap." | "tap_in." | "aux." | "state." | "" | "input." | "param." | "grad."
const char* role_prefix(Role r);

struct RecordEntry {
  Role role = Role::Tap;
  std::string name;  // module path or output name, without the role prefix
  Tensor value;
  RoundingCount rounding;  // rounding points executed before this value
  // The magnitude this value's error scales with, when not its own largest element (router
  // probabilities and losses move with the logits' absolute error); < 0: max |value|.
  double magnitude = -1.0;
  // One magnitude per block of the last dim, when the error's scale varies along the tensor (a
  // core attention output's per (token, head): core/attention_bound.h): F64, the value's shape with
  // its last dim the number of equal blocks; element i's is block_magnitude[i / block length].
  // Undefined: `magnitude` for every element.
  Tensor block_magnitude;
  // Tables: one label per element, naming the row a mismatch is in, and how a cell is shown
  // (codes of Python exceptions by name); null: as a number.
  std::vector<std::string> row_labels;
  std::function<std::string(double)> show;

  std::string key() const { return role_prefix(role) + name; }
};

struct Record {
  std::vector<RecordEntry> entries;  // in computation order
  std::map<std::string, int> calls;  // how often each tap path was recorded

  // Appends an entry with the running rounding count.
  RecordEntry& add(Role role, std::string name, Tensor value);
  // A parameter handed out as a module output (a skip_bias_add bias): no rounding point.
  RecordEntry& add_exact(Role role, std::string name, Tensor value);
  // The first entry of that role and name, or null.
  const Tensor* find(const std::string& name, Role role = Role::Tap) const;
};

}  // namespace twin
