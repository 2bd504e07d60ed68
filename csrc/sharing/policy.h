// What one member of a shared GPU may reserve, given the others' floors, and what floor it may be
// granted (docs/design.md, "Sharing one GPU between processes"). Pure arithmetic, saturating:
// figures come from a shared file (bounded by the device as they are read, sharing/table.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace gpumem {

// Another member as the policy sees it.
struct ShareMember {
  std::size_t floor = 0;
  std::size_t reserved = 0;
  std::size_t in_use = 0;
};

// What a member keeps whatever the others need: its floor, or its live tensors above it. Its
// cache above that is what asking gives back.
inline std::size_t claim_of(const ShareMember& m) { return std::max(m.floor, std::min(m.in_use, m.reserved)); }
// The floor a member has not yet reserved: what the others' ceilings leave free for it.
inline std::size_t unreserved_floor(const ShareMember& m) { return m.floor > m.reserved ? m.floor - m.reserved : 0; }
// What a member has beyond its floor: borrowed.
inline std::size_t borrowed(std::size_t reserved, std::size_t floor) { return reserved > floor ? reserved - floor : 0; }

inline std::size_t saturating_add(std::size_t a, std::size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

// The floor a member asking for `asked` bytes is granted: what the device leaves after the
// others' floors (each counted once, as held now), so that floors add up to the device at most.
inline std::size_t grantable_floor(std::size_t asked, std::size_t total, std::size_t others_floors) {
  const std::size_t left = others_floors < total ? total - others_floors : 0;
  return std::min(asked, left);
}

// Sums the others' claims as the ceiling's rule needs them.
struct ShareTally {
  std::size_t claims = 0;     // sum of claim_of
  std::size_t reserved = 0;   // sum of the others' reserved
  std::size_t floors_left = 0;  // sum of unreserved_floor
  std::size_t floors = 0;       // sum of the floors
  void add(const ShareMember& m) {
    floors = saturating_add(floors, m.floor);
    claims = saturating_add(claims, claim_of(m));
    reserved = saturating_add(reserved, m.reserved);
    floors_left = saturating_add(floors_left, unreserved_floor(m));
  }
};

// The memory the device holds outside every member's reserved bytes (contexts, native processes),
// from one reading of the device: total - free - (mine + the others' reserved).
inline std::size_t unaccounted(std::size_t total, std::size_t free, std::size_t mine, const ShareTally& others) {
  const std::size_t used = total - std::min(free, total);
  const std::size_t members = saturating_add(mine, others.reserved);
  return used > members ? used - members : 0;
}

// What this member's reserved may grow to: the device less what it holds outside the members,
// less each other member's claim. That is what the device could give if every other member gave
// back its cache, less the floors they have not reserved yet; with none of those it is no limit at
// all (SIZE_MAX): the device itself refuses, and what it refuses is asked for. The hard cap is
// applied by Cap, not here.
// The room itself, whatever the floors: what a floor of this member can be honoured up to.
inline std::size_t share_room(std::size_t total, std::size_t unaccounted_bytes, const ShareTally& others) {
  const std::size_t taken = saturating_add(unaccounted_bytes, others.claims);
  return taken < total ? total - taken : 0;
}
inline std::size_t share_ceiling(std::size_t total, std::size_t unaccounted_bytes, const ShareTally& others) {
  return others.floors_left == 0 ? SIZE_MAX : share_room(total, unaccounted_bytes, others);
}

}  // namespace gpumem
