#include "parity/diff_cmd.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>

#include "fixtures/fixture.h"
#include "parity/capture_diff.h"
#include "parity/cli_common.h"
#include "parity/report.h"

namespace twin::cli {

namespace {

std::string list(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s;
}

}  // namespace

int run_diff(const DiffOptions& opt, std::ostream& out, std::ostream& err) {
  using json = nlohmann::json;
  std::optional<std::string> kind;
  parity::CaptureDiff d;
  // Two commits' captures of one layer from the same inputs and parameters: whatever differs bit
  // for bit is what changed between the commits (a capture is deterministic on one commit).
  std::string commits;  // "93ddc247 (January 2026) -> d98e8a64 (August 2026)" when they differ
  std::optional<parity::CaptureDiff> bits;
  try {
    const Fixture a = load_fixture(opt.a), b = load_fixture(opt.b);
    kind = a.kind;
    d = parity::diff_captures(a, b, parity::DiffMode{opt.exact});
    auto name = [](const Fixture& f) { return f.megatron ? f.megatron->name : f.megatron_commit; };
    if (a.megatron != b.megatron || (!a.megatron && a.megatron_commit != b.megatron_commit)) {
      commits = name(a) + " -> " + name(b);
      if (d.differing_given.empty()) bits = opt.exact ? d : parity::diff_captures(a, b, parity::DiffMode{true});
    }
  } catch (...) {
    const std::string message = describe_exception(std::current_exception());
    if (opt.json)
      out << json{{"a", opt.a},
                  {"b", opt.b},
                  {"kind", nullptr},
                  {"status", status_name(Status::Error)},
                  {"message", message},
                  {"first_divergence", nullptr},
                  {"differing_given", json::array()},
                  {"tensors", json::array()}}
                 .dump()
          << "\n";
    else
      err << "error: " << message << "\n";
    return 2;
  }

  const int computed = static_cast<int>(d.rows.size()) - d.given;
  std::string message;
  if (opt.exact) {
    int differ = 0;
    for (const auto& r : d.rows) differ += !r.pass;
    message = d.diverges() ? fmt::format("{} of {} tensors differ; first difference: {} at {}", differ, d.rows.size(),
                                         d.first_divergence_name(), d.rows[d.first_divergence].worst_index_str())
                           : fmt::format("{} tensors equal bit for bit", d.rows.size());
  } else if (d.diverges()) {
    int out_of_bound = 0;
    for (std::size_t i = static_cast<std::size_t>(d.given); i < d.rows.size(); ++i) out_of_bound += !d.rows[i].pass;
    message = fmt::format("{} of {} computed tensors out of bound; first divergence: {}", out_of_bound, computed,
                          d.first_divergence_name());
  } else {
    message = fmt::format("{} computed tensors within bound", computed);
  }
  if (!d.differing_given.empty() && !opt.exact)
    message += fmt::format("; {} of {} inputs and parameters differ", d.differing_given.size(), d.given);
  const bool semantics_differ = bits && bits->diverges();
  if (semantics_differ) {
    int differ = 0;
    for (const auto& r : bits->rows) differ += !r.pass;
    message = fmt::format(
        "semantics differ between these commits ({}): first changed tensor {}; {} of {} tensors "
        "differ bit for bit; {}",
        commits, bits->first_divergence_name(), differ, bits->rows.size(), message);
  }
  const Status status = d.diverges() || semantics_differ ? Status::Fail : Status::Pass;

  if (opt.json) {
    out << json{{"a", opt.a},
                {"b", opt.b},
                {"kind", *kind},
                {"status", status_name(status)},
                {"message", message},
                {"first_divergence", d.diverges() ? json(d.first_divergence_name()) : json(nullptr)},
                {"commits", commits.empty() ? json(nullptr) : json(commits)},
                {"semantics_differ", semantics_differ},
                {"first_changed", semantics_differ ? json(bits->first_divergence_name()) : json(nullptr)},
                {"differing_given", d.differing_given},
                {"grads", d.grads},
                {"routing", d.routing.empty() ? json(nullptr) : json(d.routing)},
                {"exact", opt.exact},
                {"tensors", rows_json(d.rows)}}
               .dump()
        << "\n";
  } else {
    out << fmt::format("{} vs {}  [kind {}; {}{}]\n", opt.a, opt.b, *kind,
                       opt.exact ? "bit for bit" : "bounds from the reference twin's rounding counts on A",
                       commits.empty() ? "" : "; Megatron-Core " + commits);
    print_rows(out, d.rows, d.first_divergence,
               RowWords{opt.exact ? "first difference" : "first divergence", "A", "B"});
    out << (d.differing_given.empty()
                ? fmt::format("  inputs and parameters: all {} equal\n", d.given)
                : fmt::format("  inputs and parameters that differ: {}\n", list(d.differing_given)));
    if (!d.routing.empty()) out << fmt::format("  routing: {}\n", d.routing);
    out << fmt::format("  gradients: {}{}\n", d.grads,
                       d.not_compared ? fmt::format(" ({} grad.* tensors)", d.not_compared) : "");
    out << fmt::format("  {}: {}\n",
                       semantics_differ ? "SEMANTICS DIFFER"
                       : d.diverges()   ? "DIVERGE"
                                        : "SAME",
                       message);
  }
  return status == Status::Fail ? 1 : 0;
}

}  // namespace twin::cli
