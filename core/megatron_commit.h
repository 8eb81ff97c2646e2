// Which Megatron-Core a golden is held to. A golden records the commit it came from
// (__metadata__.megatron_commit); the commit picks a small, named set of behaviour switches, and
// code reads the switches, never the commit. Each switch is a difference in a layer's numbers (or
// in what exists) between the two commits this project knows, read from both commits' code and
// confirmed by running them (README: "Megatron-Core commits").
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config.h"

namespace twin {

struct MegatronSemantics {
  std::string commit;  // the full hash
  std::string name;    // the short hash and when, for messages: "d98e8a64 (August 2026)"
  // Retro (megatron/core/models/retro) was removed upstream hours after the January pin.
  bool has_retro = true;
  MegatronSwitches switches;
  // TransformerLayer keeps the residual in fp32 under fp32_residual_connection, and bias-dropout-add
  // casts to the residual's dtype (the pin ignores the flag inside a layer). Not a switch yet: the
  // twins refuse such a layer at this commit (unimplemented_semantics).
  bool layer_fp32_residual = false;
  // TransformerConfig fields this commit no longer has; a config that sets one to anything but its
  // old default describes a layer this commit cannot build.
  std::vector<std::string> removed_fields;
};

// The commits this project knows, the January pin first.
const std::vector<MegatronSemantics>& known_megatron_commits();
// The January pin (93ddc247): what a golden without __metadata__.megatron_commit is held to.
const MegatronSemantics& pinned_megatron();
// A known commit by its hash or a prefix of 7 hex digits or more; ConfigError naming the known ones.
const MegatronSemantics& megatron_semantics(const std::string& commit);
// The same, or null for a commit the twins do not know.
const MegatronSemantics* find_megatron_semantics(const std::string& commit);
// "unknown Megatron-Core commit '...': the twins know ..." (the one message for it).
std::string unknown_megatron_commit(const std::string& commit);

// ConfigError when a golden's config JSON sets a field `m` no longer has to anything but its old
// default, naming the field and the commit.
void check_config_fields(const MegatronSemantics& m, const nlohmann::json& config);

// The first difference of `m` from the January pin that `config` (of fixture kind `kind`) meets
// and the twins do not implement yet, or "" when they hold the layer to m's semantics. Goldens
// that meet one are reported unsupported, never compared against the pin's numbers.
std::string unimplemented_semantics(const MegatronSemantics& m, const TransformerConfig& config,
                                    const std::string& kind);

}  // namespace twin
