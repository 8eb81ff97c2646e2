#include "tests/parity/dense_case_gen.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "tests/case_id.h"

namespace twin::parity {

namespace {
// One of a field's samples, uniformly whatever the case size (every dtype, tp and layer number in
// each run's default case count); a failing case shrinks toward the first (simplest) sample.
std::string draw_sample(const std::vector<std::string>& samples) { return *proptest::gen_uniform_element(samples); }
}  // namespace

rc::Gen<DenseCase> gen_dense_case(CaseLimits lim) {
  // TWIN_CASE='dense(...)' reruns one case (tests/case_id.h): the same id `twin case` takes.
  if (const char* id = proptest::rerun_request("dense")) return rc::gen::just(parse_case_id(id));
  return rc::gen::exec([lim]() {
    const auto& fields = dense_case_fields();
    auto field = [&](const char* key) -> const CaseField<DenseCase>& { return find_field(fields, key); };
    // A count drawn in [1, n], n clipped to the field's range (the id's own limits).
    auto upto = [&](const char* key, int n) { return *rc::gen::inRange(1, std::min(n, int(field(key).range.hi)) + 1); };
    DenseCase c;
    std::set<std::string> derived;  // fields set below from the parallel layout or the limits

    // The parallel layout first: the sizes that must divide by tp are multiples of it, so each
    // shrink step is a valid case too.
    std::vector<std::string> tps;
    for (const auto& t : field("tp").samples)
      if (std::stoi(t) <= lim.max_tp) tps.push_back(t);
    field("tp").parse(c, lim.force_tp ? std::to_string(lim.tp) : draw_sample(tps));
    field("sp").parse(c, c.tp > 1 ? draw_sample(field("sp").samples) : "0");
    c.groups = c.tp * upto("g", lim.max_groups_per_rank);
    c.heads = c.groups * upto("a", lim.max_heads_per_group);
    c.ffn = c.tp * 4 * upto("ffn", 4);
    const int s_per_rank = upto("s", lim.max_s_per_rank);
    c.s = c.sp ? c.tp * s_per_rank : s_per_rank + *rc::gen::inRange(0, 3);
    if (c.s < lim.min_s) {  // past min_s in steps that keep s % tp == 0 under SP
      const int step = c.sp ? c.tp : 1;
      c.s += (lim.min_s - c.s + step - 1) / step * step + step * *rc::gen::inRange(0, 3);
    }
    c.b = upto("b", lim.max_b);
    derived.insert({"tp", "sp", "g", "a", "ffn", "s", "b"});
    if (!lim.any_dtype) {
      c.dtype = lim.dtype;
      derived.insert("dtype");
    }
    if (!lim.allow_dropout) {
      c.dropout = 0.0;
      derived.insert("drop");
    }

    // Every other field with samples, from the table, in id order.
    for (const auto& f : fields)
      if (!f.samples.empty() && !derived.count(f.key)) f.parse(c, draw_sample(f.samples));

    c.seed = *rc::gen::inRange<std::uint64_t>(1, 1000000);
    validate(c);
    return c;
  });
}

}  // namespace twin::parity
