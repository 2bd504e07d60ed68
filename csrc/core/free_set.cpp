#include "core/free_set.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace gpumem {

// ---- the red-black tree of one size class ----
//
// Nodes are blocks ordered by (size, address); a null child is a black leaf. The algorithms are
// CLRS's, written once for both directions: child[d] and child[1 - d] are mirror images.

namespace {

FreeLink& link(Block* b) { return b->where; }
bool is_red(const Block* b) { return b && b->where.red; }
bool before(const Block* a, const Block* b) { return a->size != b->size ? a->size < b->size : a->addr < b->addr; }
int side_of(const Block* child, const Block* parent) { return parent->where.child[1] == child ? 1 : 0; }

// Puts `to` where `from` hangs (under from's parent, or as the root).
void replace(Block*& root, Block* from, Block* to) {
  Block* parent = link(from).parent;
  if (!parent) {
    root = to;
  } else {
    link(parent).child[side_of(from, parent)] = to;
  }
  if (to) link(to).parent = parent;
}

// Moves `x` down to side `d`; its child on the other side takes its place.
void rotate(Block*& root, Block* x, int d) {
  Block* y = link(x).child[1 - d];
  Block* inner = link(y).child[d];
  link(x).child[1 - d] = inner;
  if (inner) link(inner).parent = x;
  replace(root, x, y);
  link(y).child[d] = x;
  link(x).parent = y;
}

template <typename B>  // Block or const Block
B* extreme(B* b, int d) {
  while (B* c = b->where.child[d]) b = c;
  return b;
}

// Rebalancing is rare in practice (a class mostly holds one or two blocks), so it stays out of
// line and the common paths below stay small.
[[gnu::noinline]] void insert_fixup(Block*& root, Block* z) {
  while (is_red(link(z).parent)) {
    Block* p = link(z).parent;
    Block* g = link(p).parent;  // exists: a red node is not the root
    const int pd = side_of(p, g);
    Block* uncle = link(g).child[1 - pd];
    if (is_red(uncle)) {
      link(p).red = link(uncle).red = false;
      link(g).red = true;
      z = g;
      continue;
    }
    if (z == link(p).child[1 - pd]) {
      rotate(root, p, pd);
      p = z;
    }
    link(p).red = false;
    link(g).red = true;
    rotate(root, g, 1 - pd);
    break;
  }
  link(root).red = false;
}

void tree_insert(Block*& root, Block* node) {
  Block* parent = nullptr;
  int d = 0;
  for (Block* cur = root; cur; cur = link(cur).child[d]) {
    parent = cur;
    d = before(cur, node) ? 1 : 0;
  }
  FreeLink& l = link(node);  // its bins and class are the caller's
  l.parent = parent;
  l.child[0] = l.child[1] = nullptr;
  l.red = parent != nullptr;  // a new root is black
  if (!parent) {
    root = node;
    return;
  }
  link(parent).child[d] = node;
  if (link(parent).red) insert_fixup(root, node);
}

// Restores the black height after a black node left from under `parent` on the side of `x`
// (x may be null: a null leaf).
[[gnu::noinline]] void erase_fixup(Block*& root, Block* x, Block* parent) {
  while (x != root && !is_red(x)) {
    const int d = link(parent).child[0] == x ? 0 : 1;  // the sibling is not null, so this is exact
    Block* w = link(parent).child[1 - d];
    if (is_red(w)) {
      link(w).red = false;
      link(parent).red = true;
      rotate(root, parent, d);
      w = link(parent).child[1 - d];
    }
    if (!is_red(link(w).child[0]) && !is_red(link(w).child[1])) {
      link(w).red = true;
      x = parent;
      parent = link(x).parent;
      continue;
    }
    if (!is_red(link(w).child[1 - d])) {
      link(link(w).child[d]).red = false;
      link(w).red = true;
      rotate(root, w, 1 - d);
      w = link(parent).child[1 - d];
    }
    link(w).red = link(parent).red;
    link(parent).red = false;
    link(link(w).child[1 - d]).red = false;
    rotate(root, parent, d);
    x = root;
  }
  if (x) link(x).red = false;
}

// Erases `z`, which has two children: its successor takes its place and colour.
[[gnu::noinline]] void erase_inner(Block*& root, Block* z) {
  Block* left = link(z).child[0];
  Block* right = link(z).child[1];
  Block* y = extreme(right, 0);
  const bool removed_red = link(y).red;
  Block* x = link(y).child[1];  // what takes y's place
  Block* parent = y;            // x's parent
  if (link(y).parent != z) {
    parent = link(y).parent;
    replace(root, y, x);
    link(y).child[1] = right;
    link(right).parent = y;
  }
  replace(root, z, y);
  link(y).child[0] = left;
  link(left).parent = y;
  link(y).red = link(z).red;
  if (!removed_red) erase_fixup(root, x, parent);
}

void tree_erase(Block*& root, Block* z) {
  const FreeLink& l = link(z);
  if (l.child[0] && l.child[1]) return erase_inner(root, z);
  Block* x = l.child[0] ? l.child[0] : l.child[1];  // null, or a red leaf
  replace(root, z, x);
  if (l.red) return;
  if (x) {
    link(x).red = false;
  } else if (root) {
    erase_fixup(root, nullptr, l.parent);
  }
}

// The lowest (size, address) of at least `size` bytes, or nullptr.
Block* tree_lower_bound(Block* root, std::size_t size) {
  Block* found = nullptr;
  for (Block* cur = root; cur;) {
    if (cur->size >= size) {
      found = cur;
      cur = link(cur).child[0];
    } else {
      cur = link(cur).child[1];
    }
  }
  return found;
}

const Block* tree_successor(const Block* b) {
  if (const Block* right = b->where.child[1]) return extreme(right, 0);
  const Block* parent = b->where.parent;
  while (parent && parent->where.child[1] == b) {
    b = parent;
    parent = b->where.parent;
  }
  return parent;
}

unsigned ctz(std::uint64_t word) { return static_cast<unsigned>(__builtin_ctzll(word)); }

}  // namespace

// ---- the free set: bins by stream and size class ----

inline FreeBlocks::StreamBins* FreeBlocks::find(StreamId stream) const {
  if (last_ && last_->stream == stream) return last_;
  return find_slow(stream);
}

bool FreeBlocks::stream_below(const std::unique_ptr<StreamBins>& bins, StreamId stream) {
  return bins->stream < stream;
}

FreeBlocks::StreamBins* FreeBlocks::find_slow(StreamId stream) const {
  auto it = std::lower_bound(streams_.begin(), streams_.end(), stream, stream_below);
  if (it == streams_.end() || (*it)->stream != stream) return nullptr;
  return last_ = it->get();
}

inline FreeBlocks::StreamBins& FreeBlocks::find_or_add(StreamId stream) {
  StreamBins* bins = find(stream);
  return bins ? *bins : add(stream);
}

// Out of line: a new stream is rare, and inlined this would make every insert save registers.
[[gnu::noinline]] FreeBlocks::StreamBins& FreeBlocks::add(StreamId stream) {
  auto it = std::lower_bound(streams_.begin(), streams_.end(), stream, stream_below);
  it = streams_.insert(it, std::make_unique<StreamBins>());
  (*it)->stream = stream;
  return *(last_ = it->get());
}

inline unsigned FreeBlocks::next_class(const StreamBins& bins, unsigned from) {
  if (from >= kClasses) return kNone;
  unsigned w = from / 64;
  const std::uint64_t here = bins.words[w] & (~std::uint64_t{0} << (from % 64));
  if (here) return w * 64 + ctz(here);
  const std::uint64_t later = bins.summary & (~std::uint64_t{0} << (w + 1));  // w + 1 <= kWords < 64
  if (!later) return kNone;
  w = ctz(later);
  return w * 64 + ctz(bins.words[w]);
}

void FreeBlocks::insert(Block* block) {
  StreamBins& bins = find_or_add(block->stream);
  const unsigned cls = class_of(block->size);
  if (!bins.roots[cls]) {
    bins.words[cls / 64] |= std::uint64_t{1} << (cls % 64);
    bins.summary |= std::uint64_t{1} << (cls / 64);
  }
  tree_insert(bins.roots[cls], block);
  block->where.bins = &bins;
  block->where.cls = cls;
}

inline void FreeBlocks::unlink(StreamBins& bins, unsigned cls, Block* block) {
  tree_erase(bins.roots[cls], block);
  if (bins.roots[cls]) return;
  std::uint64_t& word = bins.words[cls / 64];
  word &= ~(std::uint64_t{1} << (cls % 64));
  if (!word) bins.summary &= ~(std::uint64_t{1} << (cls / 64));
}

void FreeBlocks::erase(Block* block) { unlink(*block->where.bins, block->where.cls, block); }

std::size_t FreeBlocks::size() const {
  std::size_t count = 0;
  for_each([&](const Block*) { ++count; });
  return count;
}

Block* FreeBlocks::take_best_fit(StreamId stream, std::size_t size) {
  StreamBins* bins = find(stream);
  if (!bins) return nullptr;
  unsigned cls = class_of(size);
  Block* block = tree_lower_bound(bins->roots[cls], size);
  if (!block) {
    cls = next_class(*bins, cls + 1);
    if (cls == kNone) return nullptr;
    block = extreme(bins->roots[cls], 0);
  }
  unlink(*bins, cls, block);
  return block;
}

bool FreeBlocks::contains(const Block* block) const {
  const StreamBins* bins = find(block->stream);
  if (!bins) return false;
  for (const Block* cur = bins->roots[class_of(block->size)]; cur;) {
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
  if (const Block* after = tree_successor(block)) return after;
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
