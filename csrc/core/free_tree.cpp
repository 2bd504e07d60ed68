// The red-black tree of one size class (core/free_tree.h): rebalancing, out of line.
#include "core/free_tree.h"

namespace gpumem::free_tree {

namespace {

// Moves `x` down to side `d`; its child on the other side takes its place.
void rotate(Block*& root, Block* x, int d) {
  Block* y = link(x).child[1 - d];
  Block* inner = link(y).child[d];
  link(x).set_child(1 - d, inner);
  if (inner) link(inner).set_parent(x);
  replace(root, x, y);
  link(y).set_child(d, x);
  link(x).set_parent(y);
}

}  // namespace

// Rebalancing is rare in practice (a class mostly holds one or two blocks), so it is out of line
// and the inline paths in free_tree.h stay small.

void insert_fixup(Block*& root, Block* z) {
  while (is_red(link(z).parent)) {
    Block* p = link(z).parent;
    Block* g = link(p).parent;  // exists: a red node is not the root
    const int pd = side_of(p, g);
    Block* uncle = link(g).child[1 - pd];
    if (is_red(uncle)) {
      link(p).set_red(false);
      link(uncle).set_red(false);
      link(g).set_red(true);
      z = g;
      continue;
    }
    if (z == link(p).child[1 - pd]) {
      rotate(root, p, pd);
      p = z;
    }
    link(p).set_red(false);
    link(g).set_red(true);
    rotate(root, g, 1 - pd);
    break;
  }
  link(root).set_red(false);
}

// Restores the black height after a black node left from under `parent` on the side of `x`
// (x may be null: a null leaf).
void erase_fixup(Block*& root, Block* x, Block* parent) {
  while (x != root && !is_red(x)) {
    const int d = link(parent).child[0] == x ? 0 : 1;  // the sibling is not null, so this is exact
    Block* w = link(parent).child[1 - d];
    if (is_red(w)) {
      link(w).set_red(false);
      link(parent).set_red(true);
      rotate(root, parent, d);
      w = link(parent).child[1 - d];
    }
    if (!is_red(link(w).child[0]) && !is_red(link(w).child[1])) {
      link(w).set_red(true);
      x = parent;
      parent = link(x).parent;
      continue;
    }
    if (!is_red(link(w).child[1 - d])) {
      link(link(w).child[d]).set_red(false);
      link(w).set_red(true);
      rotate(root, w, 1 - d);
      w = link(parent).child[1 - d];
    }
    link(w).set_red(link(parent).red);
    link(parent).set_red(false);
    link(link(w).child[1 - d]).set_red(false);
    rotate(root, parent, d);
    x = root;
  }
  if (x) link(x).set_red(false);
}

// Erases `z`, which has two children: its successor takes its place and colour.
void erase_inner(Block*& root, Block* z) {
  Block* left = link(z).child[0];
  Block* right = link(z).child[1];
  Block* y = extreme(right, 0);
  const bool removed_red = link(y).red;
  Block* x = link(y).child[1];  // what takes y's place
  Block* parent = y;            // x's parent
  if (link(y).parent != z) {
    parent = link(y).parent;
    replace(root, y, x);
    link(y).set_child(1, right);
    link(right).set_parent(y);
  }
  replace(root, z, y);
  link(y).set_child(0, left);
  link(left).set_parent(y);
  link(y).set_red(link(z).red);
  if (!removed_red) erase_fixup(root, x, parent);
}

const Block* successor(const Block* b) {
  if (const Block* right = b->where.child[1]) return extreme(right, 0);
  const Block* parent = b->where.parent;
  while (parent && parent->where.child[1] == b) {
    b = parent;
    parent = b->where.parent;
  }
  return parent;
}

}  // namespace gpumem::free_tree
