// Streams: a segment serves its own stream, and a block used on another stream (record_stream) is
// reused only after an event recorded there at free time has completed.
#include "helpers.h"

using namespace gpumem_test;

TEST_CASE("a block used on another stream is not reused until that stream's work is done", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  Block* keep = sim.malloc(512);  // keeps a from merging with the free tail
  const std::uintptr_t a_addr = a->addr;
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  REQUIRE(sim.ledger().live_events == 1);

  Block* b = sim.malloc(4 * KiB);
  REQUIRE(b->addr != a_addr);
  sim.free(b);

  sim.backend.complete_events();
  Block* c = sim.malloc(4 * KiB);
  REQUIRE(c->addr == a_addr);
  REQUIRE(sim.ledger().live_events == 0);
  (void)keep;
}

TEST_CASE("a block is reused once its event reports done on a later query", "[streams]") {
  Sim sim;
  sim.backend.auto_complete_after(2);
  Block* a = sim.malloc(4 * KiB);
  Block* keep = sim.malloc(512);
  const std::uintptr_t a_addr = a->addr;
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);

  Block* first = sim.malloc(4 * KiB);  // the event's first query: not done yet
  REQUIRE(first->addr != a_addr);
  Block* second = sim.malloc(4 * KiB);  // the second query: done
  REQUIRE(second->addr == a_addr);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.ledger().syncs == 0);
  (void)keep;
}

TEST_CASE("a freed block in use on another stream stays active but not allocated", "[streams][stats]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  DeviceStats s = sim.stats();
  REQUIRE(s.allocated_bytes[kAll].current == 0);
  REQUIRE(s.allocation[kAll].current == 0);
  REQUIRE(s.active[kAll].current == 1);
  REQUIRE(s.active_bytes[kAll].current == static_cast<std::int64_t>(4 * KiB));
  REQUIRE(sim.snapshot()[0].blocks[0].state == BlockInfo::kPendingFree);
  REQUIRE(sim.alloc.largest_free_block() == 2 * MiB - 4 * KiB);

  sim.backend.complete_events();
  sim.malloc(512, kStream2);  // a request looks at the events
  s = sim.stats();
  REQUIRE(s.active[kSmallPool].current == 1);  // only the new 512-byte block
  REQUIRE(s.active_bytes[kSmallPool].current == 512);
}

TEST_CASE("recording the same stream twice waits on one event", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  sim.alloc.record_stream(a, kStream1);
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  REQUIRE(sim.ledger().live_events == 1);
}

TEST_CASE("a block recorded on two streams waits on an event on each", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  sim.alloc.record_stream(a, kStream1);
  sim.alloc.record_stream(a, kStream2);
  sim.free(a);
  REQUIRE(sim.ledger().live_events == 2);
  sim.backend.complete_events();
  sim.malloc(512, kStream3);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.stats().active[kAll].current == 1);
}

TEST_CASE("recording the block's own stream changes nothing", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB, kStream1);
  Block* keep = sim.malloc(512, kStream1);
  const std::uintptr_t a_addr = a->addr;
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.malloc(4 * KiB, kStream1)->addr == a_addr);
  (void)keep;
}

TEST_CASE("a free block is reused only on its own stream", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(12 * MiB, kStream1);
  const std::uintptr_t a_addr = a->addr;
  sim.free(a);

  Block* other = sim.malloc(12 * MiB, kStream2);
  REQUIRE(other->addr != a_addr);
  REQUIRE(sim.ledger().reserves == 2);
  Block* same = sim.malloc(12 * MiB, kStream1);
  REQUIRE(same->addr == a_addr);
  REQUIRE(sim.ledger().reserves == 2);
}

TEST_CASE("a segment's free remainder does not serve another stream", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB, kStream1);  // leaves 2 MiB - 4 KiB free in its segment
  Block* b = sim.malloc(4 * KiB, kStream2);
  REQUIRE(sim.segment_of(b).addr != sim.segment_of(a).addr);
  REQUIRE(sim.segment_of(b).stream == kStream2);
  REQUIRE(sim.ledger().reserves == 2);
}

TEST_CASE("each stream's blocks are tagged with the segment's stream", "[streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB, kStream2);
  Block* b = sim.malloc(5 * MiB, kStream3);
  REQUIRE(a->stream == kStream2);
  REQUIRE(b->stream == kStream3);
  REQUIRE(sim.segment_of(a).stream == kStream2);
  REQUIRE(sim.segment_of(b).stream == kStream3);
}

TEST_CASE("events are destroyed once their block is reused", "[streams]") {
  Sim sim;
  std::vector<Block*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(sim.malloc(4 * KiB));
  for (Block* b : blocks) {
    sim.alloc.record_stream(b, kStream1);
    sim.free(b);
  }
  REQUIRE(sim.ledger().live_events == 8);
  sim.backend.complete_events();
  sim.malloc(4 * KiB);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.snapshot()[0].blocks.size() == 2);  // all eight merged back into the free tail
}
