#include "reference/taps.h"

#include "core/progress.h"

namespace twin::reference {

Mat Taps::record(const std::string& name, const Mat& m, Shape shape, DType dtype) const {
  if (!record_) return m;
  const Tensor* s = add(Role::Tap, name,
                        Tensor::from_doubles(dtype, shape, std::vector<double>(m.data(), m.data() + m.size())), false);
  return s ? to_mat(*s, m.rows(), m.cols(), prefix_ + name) : m;
}

const Tensor* Taps::add(Role role, const std::string& name, const Tensor& t, bool exact) const {
  if (!record_) return nullptr;
  std::string full = prefix_ + name;
  const int n = record_->calls[role_prefix(role) + full]++;
  if (n > 0) full += "#" + std::to_string(n);
  if (role == Role::Tap) progress::done(full);
  const RecordEntry& e = exact ? record_->add_exact(role, std::move(full), t) : record_->add(role, std::move(full), t);
  if (exact || !substitutes_ || !*substitutes_) return nullptr;
  const Tensor* s = (*substitutes_)(e.key());
  if (!s || s->shape() != t.shape() || is_floating(s->dtype()) != is_floating(t.dtype())) return nullptr;
  if (is_floating(s->dtype())) {
    // What the substitute carries: one store in its dtype. An integer or bool substitute (a
    // routing map) carries no rounding and leaves the count of the floating values beside it.
    RoundingCount carried;
    carried.store(s->dtype());
    rounding_set(carried);
  }
  return s;
}

}  // namespace twin::reference
