// A block freed during a capture while other streams used it: held until the capture ends, or,
// with capture reuse on, until the capture joins those streams back into the block's stream.
#include "helpers.h"

using namespace gpumem_test;

namespace {

constexpr PoolId kGraph{1, 0};

// A graph capturing on streams 1, 2 and 3 into its pool, reuse on or off.
struct Capture {
  explicit Capture(Sim& sim, bool reuse) : sim(sim) {
    sim.alloc.create_pool(kGraph);
    sim.alloc.set_capture_reuse(reuse);
    sim.alloc.begin_allocate_to_pool(kGraph, [](StreamId s) { return s != kStream0; });
  }
  void end() { sim.alloc.end_allocate_to_pool(kGraph); }
  Sim& sim;
};

// Allocates `a` on stream 1, uses it on the given streams, frees it: returns its address.
std::uintptr_t used_then_freed(Sim& sim, std::initializer_list<StreamId> users) {
  Block* a = sim.malloc(4096, kStream1);
  for (StreamId s : users) sim.alloc.record_stream(a, s);
  const std::uintptr_t addr = a->addr;
  sim.free(a);
  return addr;
}

}  // namespace

TEST_CASE("without capture reuse a block used by another stream waits for the capture to end", "[capture]") {
  Sim sim;
  Capture capture(sim, false);
  Block* sink = sim.malloc(4096, kStream1);
  const std::uintptr_t freed = used_then_freed(sim, {kStream2});
  sim.backend.wait_stream(0, kStream1, kStream2);
  Block* next = sim.malloc(4096, kStream1);
  REQUIRE(next->addr != freed);
  capture.end();
  sim.free(next);
  sim.free(sink);
}

TEST_CASE("with capture reuse a block is not reused before its stream joins the user", "[capture]") {
  Sim sim;
  Capture capture(sim, true);
  Block* sink = sim.malloc(4096, kStream1);
  const std::uintptr_t freed = used_then_freed(sim, {kStream2});
  Block* before_join = sim.malloc(4096, kStream1);
  REQUIRE(before_join->addr != freed);
  sim.backend.wait_stream(0, kStream1, kStream2);
  Block* after_join = sim.malloc(4096, kStream1);
  REQUIRE(after_join->addr == freed);
  capture.end();
  for (Block* b : {sink, before_join, after_join}) sim.free(b);
}

TEST_CASE("with capture reuse a block used on several streams waits for all of them to join", "[capture]") {
  Sim sim;
  Capture capture(sim, true);
  Block* sink = sim.malloc(4096, kStream1);
  const std::uintptr_t freed = used_then_freed(sim, {kStream2, kStream3});
  sim.backend.wait_stream(0, kStream1, kStream2);
  Block* partial = sim.malloc(4096, kStream1);
  REQUIRE(partial->addr != freed);
  // Stream 3 joins stream 2, which stream 1 joins again: stream 1 now follows both.
  sim.backend.wait_stream(0, kStream2, kStream3);
  sim.backend.wait_stream(0, kStream1, kStream2);
  Block* joined = sim.malloc(4096, kStream1);
  REQUIRE(joined->addr == freed);
  capture.end();
  for (Block* b : {sink, partial, joined}) sim.free(b);
}

TEST_CASE("a block whose user's work cannot be marked waits for the capture to end", "[capture]") {
  Sim sim;
  sim.backend.refuse_capture_markers(true);
  Capture capture(sim, true);
  Block* sink = sim.malloc(4096, kStream1);
  const std::uintptr_t freed = used_then_freed(sim, {kStream2});
  sim.backend.wait_stream(0, kStream1, kStream2);
  Block* next = sim.malloc(4096, kStream1);
  REQUIRE(next->addr != freed);
  capture.end();
  REQUIRE(sim.stats().allocated_bytes[kAll].current == 2 * 4096);
  for (Block* b : {sink, next}) sim.free(b);
}

TEST_CASE("a block still deferred when the capture ends waits for its events as usual", "[capture]") {
  Sim sim;
  Capture capture(sim, true);
  const std::uintptr_t freed = used_then_freed(sim, {kStream2});
  capture.end();
  REQUIRE(sim.ledger().live_events == 1);
  auto state_at = [&](std::uintptr_t addr) {
    for (const SegmentInfo& s : sim.snapshot()) {
      for (const BlockInfo& b : s.blocks) {
        if (b.addr == addr) return b.state;
      }
    }
    FAIL("no block there");
    return BlockInfo::kFree;
  };
  REQUIRE(state_at(freed) == BlockInfo::kPendingFree);
  sim.backend.complete_events();
  sim.free(sim.malloc(100));  // a request outside capture settles the events
  REQUIRE(state_at(freed) == BlockInfo::kFree);
}
