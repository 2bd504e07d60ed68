// The free set (core/free_set.h): the out-of-line half (the slow best fit, bins made on first use, walks, counts, the checker's check).
#include "core/free_set.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace gpumem {

using free_tree::before;
using free_tree::extreme;
using free_tree::is_red;

// ---- the free set: bins by stream and size class ----

bool FreeBlocks::stream_below(const std::unique_ptr<StreamBins>& bins, StreamId stream) {
  return bins->stream < stream;
}

FreeBins* FreeBlocks::existing_bins(StreamId stream) const {
  auto it = std::lower_bound(streams_.begin(), streams_.end(), stream, stream_below);
  return it == streams_.end() || (*it)->stream != stream ? nullptr : it->get();
}

FreeBlocks::StreamBins* FreeBlocks::find_slow(StreamId stream) const {
  StreamBins* bins = existing_bins(stream);
  if (bins) last_ = bins;
  return bins;
}

// Out of line: a new stream is rare, and inlined this would make every insert save registers.
FreeBlocks::StreamBins& FreeBlocks::add(StreamId stream) {
  auto it = std::lower_bound(streams_.begin(), streams_.end(), stream, stream_below);
  it = streams_.insert(it, std::make_unique<StreamBins>());
  (*it)->stream = stream;
  return *(last_ = it->get());
}

std::size_t FreeBlocks::size() const {
  std::size_t count = 0;
  for_each([&](const Block*) { ++count; });
  return count;
}

bool FreeBlocks::contains(const Block* block) const {
  const StreamBins* bins = find(block->stream);
  return bins && contains_in(*bins, block);
}

bool FreeBlocks::contains_in(const FreeBins& bins, const Block* block) {
  for (const Block* cur = bins.roots[class_of(block->size)]; cur;) {
    if (cur == block) return true;
    cur = cur->where.child[before(cur, block) ? 1 : 0];
  }
  return false;
}

const Block* FreeBlocks::first(const StreamBins& bins) {
  const unsigned cls = next_class(bins, 0);
  return cls == kNone ? nullptr : extreme(bins.roots[cls], 0);
}

const Block* FreeBlocks::next(const StreamBins& bins, const Block* block) {
  if (const Block* after = free_tree::successor(block)) return after;
  const unsigned cls = next_class(bins, class_of(block->size) + 1);
  return cls == kNone ? nullptr : extreme(bins.roots[cls], 0);
}

namespace {

[[noreturn]] void broken_free_set(const char* what) {
  throw std::logic_error(std::string("gpumem free set broken: ") + what);
}

// Checks the subtree under `b` (inside [lo, hi] in (size, address) order) and returns its black
// height and block count.
std::pair<int, std::size_t> check_tree(const Block* b, const Block* parent, const Block* lo, const Block* hi,
                                       const FreeBins& bins, unsigned cls) {
  if (!b) return {1, 0};
  const FreeLink& l = b->where;
  const StreamId stream = bins.stream;
  if (l.parent != parent) broken_free_set("a parent link disagrees");
  if (l.bins != &bins || l.cls != cls) broken_free_set("a block's link names other bins or another class");
  if ((lo && before(b, lo)) || (hi && before(hi, b))) broken_free_set("a tree is out of (size, address) order");
  if (b->stream != stream || FreeBlocks::class_of(b->size) != cls) broken_free_set("a block is in the wrong bin");
  if (l.red && (is_red(l.child[0]) || is_red(l.child[1]))) broken_free_set("a red block has a red child");
  const auto [left_height, left_count] = check_tree(l.child[0], b, lo, b, bins, cls);
  const auto [right_height, right_count] = check_tree(l.child[1], b, b, hi, bins, cls);
  if (left_height != right_height) broken_free_set("black heights differ");
  return {left_height + (l.red ? 0 : 1), left_count + right_count + 1};
}

}  // namespace

void FreeBlocks::check() const {
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    const StreamBins& bins = *streams_[i];
    if (i > 0 && streams_[i - 1]->stream >= bins.stream) broken_free_set("streams are out of order");
    for (unsigned w = 0; w < kWords; ++w) {
      if (((bins.summary >> w) & 1) != (bins.words[w] != 0)) broken_free_set("a summary bit is wrong");
    }
    for (unsigned cls = 0; cls < kClasses; ++cls) {
      const Block* root = bins.roots[cls];
      if (((bins.words[cls / 64] >> (cls % 64)) & 1) != (root != nullptr)) broken_free_set("a class bit is wrong");
      if (is_red(root)) broken_free_set("a root is red");
      check_tree(root, nullptr, nullptr, nullptr, bins, cls);
    }
  }
}

}  // namespace gpumem
