#include "core/record.h"

#include <utility>

namespace twin {

const char* role_prefix(Role r) {
  switch (r) {
    case Role::Output:
      return "output.";
    case Role::Tap:
      return "tap.";
    case Role::TapIn:
      return "tap_in.";
    case Role::Aux:
      return "aux.";
    case Role::State:
      return "state.";
    case Role::Column:
      return "";
    case Role::Input:
      return "input.";
    case Role::Param:
      return "param.";
    case Role::Grad:
      return "grad.";
  }
  return "";
}

RecordEntry& Record::add(Role role, std::string name, Tensor value) {
  RecordEntry e;
  e.role = role;
  e.name = std::move(name);
  e.value = std::move(value);
  e.rounding = rounding_now();
  entries.push_back(std::move(e));
  return entries.back();
}

RecordEntry& Record::add_exact(Role role, std::string name, Tensor value) {
  RecordEntry& e = add(role, std::move(name), std::move(value));
  e.rounding = RoundingCount{};
  return e;
}

const Tensor* Record::find(const std::string& name, Role role) const {
  for (const auto& e : entries)
    if (e.role == role && e.name == name) return &e.value;
  return nullptr;
}

}  // namespace twin
