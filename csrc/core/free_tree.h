// The red-black tree of one size class of the free set (core/free_set.h). Its nodes are the free
// blocks themselves (Block::where), ordered by (size, address); a null child is a black leaf. The
// algorithms are CLRS's, written once for both directions: child[d] and child[1 - d] are mirror
// images.
//
// Insert, erase and lower_bound run on every cached allocation and free, so they are inline here;
// rebalancing, rare because a class mostly holds one or two blocks, is out of line in
// free_tree.cpp.
#pragma once

#include <cstddef>

#include "core/block.h"

namespace gpumem::free_tree {

inline FreeLink& link(Block* b) { return b->where; }
inline bool is_red(const Block* b) { return b && b->where.red; }
inline bool before(const Block* a, const Block* b) { return a->size != b->size ? a->size < b->size : a->addr < b->addr; }
inline int side_of(const Block* child, const Block* parent) { return parent->where.child[1] == child ? 1 : 0; }

// Puts `to` where `from` hangs (under from's parent, or as the root).
inline void replace(Block*& root, Block* from, Block* to) {
  Block* parent = link(from).parent;
  if (!parent) {
    root = to;
  } else {
    link(parent).set_child(side_of(from, parent), to);
  }
  if (to) link(to).set_parent(parent);
}

// The last block down side `d` (0: the lowest) under `b`.
template <typename B>  // Block or const Block
B* extreme(B* b, int d) {
  while (B* c = b->where.child[d]) b = c;
  return b;
}

// Out of line (free_tree.cpp).
void insert_fixup(Block*& root, Block* z);
// Restores the black height after a black node left from under `parent` on the side of `x`
// (x may be null: a null leaf).
void erase_fixup(Block*& root, Block* x, Block* parent);
// Erases `z`, which has two children: its successor takes its place and colour.
void erase_inner(Block*& root, Block* z);
// The block after `b` in (size, address) order, or nullptr.
const Block* successor(const Block* b);

// Links `node` into the tree; its bins and class (FreeLink) are the caller's to set.
inline void insert(Block*& root, Block* node) {
  Block* parent = nullptr;
  int d = 0;
  for (Block* cur = root; cur; cur = link(cur).child[d]) {
    parent = cur;
    d = before(cur, node) ? 1 : 0;
  }
  FreeLink& l = link(node);
  l.set_parent(parent);
  l.set_child(0, nullptr);
  l.set_child(1, nullptr);
  l.set_red(parent != nullptr);  // a new root is black
  if (!parent) {
    root = node;
    return;
  }
  link(parent).set_child(d, node);
  if (link(parent).red) insert_fixup(root, node);
}

inline void erase(Block*& root, Block* z) {
  const FreeLink& l = link(z);
  if (l.child[0] && l.child[1]) return erase_inner(root, z);
  Block* x = l.child[0] ? l.child[0] : l.child[1];  // null, or a red leaf
  replace(root, z, x);
  if (l.red) return;
  if (x) {
    link(x).set_red(false);
  } else if (root) {
    erase_fixup(root, nullptr, l.parent);
  }
}

// The lowest (size, address) of at least `size` bytes, or nullptr.
inline Block* lower_bound(Block* root, std::size_t size) {
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

}  // namespace gpumem::free_tree
