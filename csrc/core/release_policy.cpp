// Which cached segments go back to the device for a request (core/release_policy.h).
#include "core/release_policy.h"

#include <algorithm>

namespace gpumem {

void sort_oldest_first(std::vector<Segment*>& segments) {
  std::sort(segments.begin(), segments.end(), [](const Segment* a, const Segment* b) { return a->serial < b->serial; });
}

std::vector<Segment*> choose_for_bytes(std::vector<Segment*> candidates, std::size_t bytes) {
  Segment* best = nullptr;
  for (Segment* s : candidates) {
    if (s->size >= bytes && (!best || s->size < best->size)) best = s;
  }
  if (best) return {best};
  sort_oldest_first(candidates);
  std::vector<Segment*> chosen;
  std::size_t freed = 0;
  for (Segment* s : candidates) {
    if (freed >= bytes) break;
    chosen.push_back(s);
    freed += s->size;
  }
  return chosen;
}

}  // namespace gpumem
