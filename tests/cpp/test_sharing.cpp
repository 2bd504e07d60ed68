// Sharing one GPU between processes (sharing/): the policy's arithmetic, the table's trust checks
// and owners, and the protocol on a simulated GPU shared by several allocators of this process or
// by forked processes (shared_sim.h).
#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fcntl.h>
#include <memory>
#include <random>
#include <string>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "helpers.h"
#include "core/growable_segments.h"
#include "sharing/member.h"
#include "sharing/policy.h"
#include "sharing/table.h"
#include "shared_sim.h"

namespace gpumem_test {
namespace {

// A private directory of this user for one test's tables, removed with the test.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/gpumem-share-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { std::system(("rm -rf " + path).c_str()); }
  std::string table() const { return path + "/share-GPU-test-uid" + std::to_string(::geteuid()) + ".table"; }
};

// One member of a shared simulated GPU, as a process would hold it: its view of the device, its
// allocator, and its table handle with the responder.
struct Member {
  SharedSim backend;
  DeviceAllocator alloc;
  DeviceHost host;
  std::unique_ptr<ShareClient> share;

  Member(SharedDevice& device, const std::string& table, std::optional<std::size_t> limit = std::nullopt,
         std::uint32_t pid = 0, ShareOptions options = test_options(), bool growable = false)
      : backend(device, growable ? 2 * MiB : 0), alloc(backend, 0, config_of(limit, growable)), host(alloc) {
    share = std::make_unique<ShareClient>(table, host, device.capacity, options, pid);
    alloc.set_share(share.get());
  }
  static ShareOptions test_options() {
    ShareOptions options;
    options.ask_wait = std::chrono::milliseconds(20000);  // ends at the answers: a bound, not a pace
    options.poll = std::chrono::milliseconds(5);
    return options;
  }
  ~Member() {
    share->stop();
    alloc.set_share(nullptr);
  }
  static AllocatorConfig config_of(std::optional<std::size_t> limit, bool growable) {
    AllocatorConfig c;
    c.limit = limit;
    c.growable = growable;
    return c;
  }
  // A member with growable segments (2 MiB pages, large requests mapped in chunks up to 256 MiB).
  static std::unique_ptr<Member> growable(SharedDevice& device, const std::string& table) {
    return std::make_unique<Member>(device, table, std::nullopt, 0, test_options(), true);
  }
};

// Returns once the member in `slot` has an ask it has not answered, as `watcher` reads the table.
void wait_until_asked(ShareTable& watcher, std::uint32_t slot) {
  for (bool asked = false; !asked;) {
    std::vector<SlotCopy> seen;
    watcher.read_others(ShareTable::kSlots, SIZE_MAX, seen);
    for (const SlotCopy& c : seen) asked = asked || (c.index == slot && c.asks != c.served);
  }
}

// The member's figures once it has answered `asks` requests (20 s at most). An asker goes on as
// soon as the memory it lacked is back on the device, a moment before the answering member counts
// it as given back and its reserved bytes drop: read either only after this.
ShareStatus status_once_served(ShareClient& share, std::uint64_t asks = 1) {
  for (int i = 0; i < 20000 && share.status().asks_served < asks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return share.status();
}

std::size_t allocated(const DeviceAllocator& a) {
  return static_cast<std::size_t>(a.stats().allocated_bytes[kAll].current);
}

// ---- pausing regions (core/pause.cpp) ----

TEST_CASE("sharing: a region resumed on a device another member's cache fills asks it, as a request does") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(1 * GiB);
  auto a = Member::growable(device, dir.table());
  auto b = Member::growable(device, dir.table());
  const PoolId region{std::uint64_t{1} << 62, 1};
  a->alloc.create_region(region);
  a->alloc.begin_allocate_to_pool(region, [](StreamId) { return true; });
  Block* kept = a->alloc.malloc(400 * MiB, kStream0);
  a->alloc.end_allocate_to_pool(region);
  const std::size_t paused = a->alloc.pause(region, false);
  b->alloc.free(b->alloc.malloc(900 * MiB, kStream0));  // B caches what A gave back, and more
  REQUIRE(b->alloc.reserved() >= 900 * MiB);
  b->share->start();  // B answers asks from now on
  REQUIRE(a->alloc.resume(region) == paused);
  a->alloc.check_invariants();
  // B's figures follow its release a moment after the device's memory did: wait for them (20 s at most).
  for (int i = 0; i < 20000 && b->share->status().given_back < paused - 124 * MiB; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(b->share->status().given_back >= paused - 124 * MiB);
  CHECK(b->alloc.reserved() <= 1 * GiB - paused);
  CHECK(device.peak.load() <= device.capacity);
  a->alloc.free(kept);
}

// ---- the policy ----

TEST_CASE("sharing policy: a member claims its floor, or its live tensors above it, never its cache") {
  CHECK(claim_of({20 * GiB, 2 * GiB, 2 * GiB}) == 20 * GiB);
  CHECK(claim_of({20 * GiB, 50 * GiB, 30 * GiB}) == 30 * GiB);
  CHECK(claim_of({0, 100 * GiB, 0}) == 0);
  CHECK(unreserved_floor({20 * GiB, 2 * GiB, 2 * GiB}) == 18 * GiB);
  CHECK(borrowed(50 * GiB, 20 * GiB) == 30 * GiB);
  CHECK(borrowed(5 * GiB, 20 * GiB) == 0);
}

TEST_CASE("sharing policy: the ceiling is the device less what it holds outside the members and the others' claims") {
  ShareTally others;
  others.add({20 * GiB, 2 * GiB, 2 * GiB});  // a service below its floor
  others.add({0, 100 * GiB, 10 * GiB});      // a hoarder: 90 GiB of cache
  const std::size_t total = 140 * GiB;
  // 1 GiB of contexts: used = 1 + my 5 + 2 + 100.
  const std::size_t outside = unaccounted(total, total - 108 * GiB, 5 * GiB, others);
  CHECK(outside == 1 * GiB);
  CHECK(share_ceiling(total, outside, others) == (140 - 1 - 20 - 10) * GiB);
}

TEST_CASE("sharing policy: with no floor left to reserve the device alone decides") {
  ShareTally others;
  others.add({20 * GiB, 25 * GiB, 25 * GiB});  // above its floor: borrowing
  others.add({0, 100 * GiB, 100 * GiB});
  CHECK(share_ceiling(140 * GiB, 10 * GiB, others) == SIZE_MAX);
}

TEST_CASE("sharing policy: figures from a hostile table saturate instead of wrapping") {
  ShareTally others;
  others.add({SIZE_MAX, SIZE_MAX, SIZE_MAX});
  others.add({SIZE_MAX, 1, 1});
  CHECK(others.claims == SIZE_MAX);
  CHECK(share_ceiling(140 * GiB, 0, others) == 0);
  CHECK(share_room(140 * GiB, SIZE_MAX, {}) == 0);
  CHECK(unaccounted(140 * GiB, 200 * GiB, 0, {}) == 0);
}

// ---- the table ----

TEST_CASE("sharing table: a file others could write, or another user's, is not trusted") {
  struct stat info {};
  info.st_mode = S_IFREG | 0600;
  info.st_uid = 1000;
  CHECK(share_file_problem(info, 1000).empty());
  CHECK(share_file_problem(info, 1001).find("belongs to uid 1000") != std::string::npos);
  info.st_mode = S_IFREG | 0644;
  CHECK(share_file_problem(info, 1000).find("mode 0644") != std::string::npos);
  info.st_mode = S_IFLNK | 0600;
  CHECK(share_file_problem(info, 1000).find("not a regular file") != std::string::npos);
}

TEST_CASE("sharing table: a table file of another user is never opened") {
  TempDir dir;
  const std::string path = dir.table();
  { ShareTable made(path); }
  if (::geteuid() != 0) {
    WARN("not root: cannot give a file to another uid; the check itself is covered above");
    return;
  }
  REQUIRE(::chown(path.c_str(), 4242, 4242) == 0);
  REQUIRE_THROWS_WITH(ShareTable(path), Catch::Contains("belongs to uid 4242"));
}

TEST_CASE("sharing table: a link or a table others can read is refused") {
  TempDir dir;
  const std::string path = dir.table();
  { ShareTable made(path); }
  REQUIRE(::chmod(path.c_str(), 0644) == 0);
  CHECK_THROWS_WITH(ShareTable(path), Catch::Contains("mode 0644"));
  REQUIRE(::chmod(path.c_str(), 0600) == 0);
  const std::string link = dir.path + "/link.table";
  REQUIRE(::symlink(path.c_str(), link.c_str()) == 0);
  CHECK_THROWS_WITH(ShareTable(link), Catch::Contains("cannot open"));
}

TEST_CASE("sharing table: a file that is not a whole table, with nobody in it, is made afresh") {
  TempDir dir;
  const std::string path = dir.table();
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "not a table", 11) == 11);
  ::close(fd);
  ShareTable table(path);
  CHECK(table.damaged().empty());
  CHECK(table.claim(42) < ShareTable::kSlots);
}

TEST_CASE("sharing table: a zero-filled table (its maker killed after sizing it) is made afresh") {
  TempDir dir;
  const std::string path = dir.table();
  const ShareLayout layout = share_layout();
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(layout.header_bytes + layout.slots * layout.slot_bytes)) == 0);
  ::close(fd);
  ShareTable a(path), b(path);
  const std::uint32_t slot = a.claim(42);
  REQUIRE(slot < ShareTable::kSlots);
  std::vector<SlotCopy> seen;
  REQUIRE(b.read_others(ShareTable::kSlots, 8 * GiB, seen));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].pid == 42);
}

TEST_CASE("sharing table: a creation lock held by a stopped process is waited for a bounded time, then named") {
  TempDir dir;
  const std::string path = dir.table();
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR, 0600);  // empty: whoever opens it must make it
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);  // as `flock FILE sleep` or a maker stopped half-way holds it
  CHECK_THROWS_WITH(ShareTable(path, std::chrono::milliseconds(200)), Catch::Contains("lock") && Catch::Contains(path));
  ::flock(fd, LOCK_UN);
  ::close(fd);
  CHECK_NOTHROW(ShareTable(path, std::chrono::milliseconds(200)));
}

TEST_CASE("sharing table: a whole table is joined while another process holds its lock") {
  TempDir dir;
  const std::string path = dir.table();
  { ShareTable made(path); }
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);
  ShareTable joined(path, std::chrono::milliseconds(200));
  CHECK(joined.claim(42) < ShareTable::kSlots);
  ::close(fd);
}

TEST_CASE("sharing table: the slot and floor of a process that died are no one's, whatever it left") {
  TempDir dir;
  ShareTable table(dir.table());
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ShareTable mine(dir.table());
    const std::uint32_t slot = mine.claim(static_cast<std::uint32_t>(::getpid()));
    mine.publish(slot, {30 * GiB, 0, 0});
    ::_exit(0);  // as a kill would: the slot is never released
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  std::vector<SlotCopy> seen;
  REQUIRE(table.read_others(ShareTable::kSlots, 140 * GiB, seen));
  CHECK(seen.empty());
  CHECK(table.claim(7) == 0);  // the dead one's slot, taken again
}

TEST_CASE("sharing table: slots parked by a writer with no live owner are free") {
  TempDir dir;
  const std::string path = dir.table();
  { ShareTable made(path); }
  const ShareLayout layout = share_layout();
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  const std::uint32_t parked = 0xffffffffu;
  for (std::size_t i = 0; i < layout.slots; ++i) {
    REQUIRE(::pwrite(fd, &parked, sizeof parked, static_cast<off_t>(layout.header_bytes + i * layout.slot_bytes)) == 4);
  }
  ::close(fd);
  ShareTable table(path), reader(path);
  CHECK(table.claim(42) == 0);
  std::vector<SlotCopy> seen;
  REQUIRE(reader.read_others(ShareTable::kSlots, 8 * GiB, seen));
  REQUIRE(seen.size() == 1);  // the new member alone: parked slots are nobody's
  CHECK(seen[0].pid == 42);
}

TEST_CASE("sharing table: a figure another process wrote is bounded by the device as it is read") {
  TempDir dir;
  ShareTable owner(dir.table()), reader(dir.table());
  const std::uint32_t slot = owner.claim(42);
  owner.publish(slot, {SIZE_MAX, SIZE_MAX, SIZE_MAX});
  std::vector<SlotCopy> seen;
  REQUIRE(reader.read_others(ShareTable::kSlots, 8 * GiB, seen));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].floor == 8 * GiB);
  CHECK(seen[0].reserved == 8 * GiB);
  CHECK(seen[0].in_use == 8 * GiB);
}

TEST_CASE("sharing table: a table cut under its mapping fails the calls instead of faulting, and says so") {
  TempDir dir;
  const std::string path = dir.table();
  ShareTable table(path);
  const std::uint32_t slot = table.claim(42);
  REQUIRE(slot < ShareTable::kSlots);
  REQUIRE(::truncate(path.c_str(), 0) == 0);
  std::vector<SlotCopy> seen;
  CHECK_FALSE(table.read_others(ShareTable::kSlots, 8 * GiB, seen));
  CHECK_FALSE(table.publish(slot, {1, 2, 3}));
  std::uint32_t wanted = 0;
  CHECK_FALSE(table.ask(slot, SIZE_MAX, wanted));
  CHECK_THAT(table.damaged(), Catch::Contains("was cut to 0 bytes"));
  ShareTable fresh(path);  // made afresh; the cut handle's slot lock still stands
  CHECK(fresh.damaged().empty());
  CHECK_THAT(table.damaged(), Catch::Contains("made afresh"));  // its member rejoins, floor granted again
  CHECK(table.publish(slot, {1, 2, 3}));  // the mapping is whole again meanwhile
  REQUIRE(fresh.read_others(ShareTable::kSlots, 8 * GiB, seen));
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].floor == 1);
}

TEST_CASE("sharing table: a full table says so instead of sharing a slot") {
  TempDir dir;
  auto table = std::make_unique<ShareTable>(dir.table());
  for (std::uint32_t i = 0; i < ShareTable::kSlots; ++i) REQUIRE(table->claim(42) == i);
  CHECK(table->claim(42) == ShareTable::kSlots);
  SharedDevice& device = SharedDevice::make(8 * GiB);
  SharedSim backend(device);
  DeviceAllocator alloc(backend, 0, Member::config_of(std::nullopt, false));
  DeviceHost host(alloc);
  CHECK_THROWS_WITH(ShareClient(dir.table(), host, device.capacity), Catch::Contains("is held by a live process"));
}

// ---- the protocol, allocators of one process ----

TEST_CASE("sharing: a hoarder's free cache goes back when the device refuses another member") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Member a(device, dir.table()), b(device, dir.table());
  a.share->start();
  b.share->start();
  Block* kept = a.alloc.malloc(1 * GiB, kStream0);
  a.alloc.free(a.alloc.malloc(100 * GiB, kStream0));
  REQUIRE(a.alloc.reserved() == 101 * GiB);

  Block* big = b.alloc.malloc(60 * GiB, kStream0);
  CHECK(big->size >= 60 * GiB);
  const ShareStatus answered = status_once_served(*a.share);
  CHECK(a.alloc.reserved() == 1 * GiB);  // its cache went, its live tensor stayed
  CHECK(kept->allocated);
  CHECK(answered.given_back == 100 * GiB);
  CHECK(answered.asks_served >= 1);
  CHECK(b.share->status().asks_made >= 1);
  Block* again = a.alloc.malloc(10 * GiB, kStream0);  // and it goes on allocating
  CHECK(again->allocated);
  a.alloc.check_invariants();
  b.alloc.check_invariants();
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: an asked member gives back what the device lacks, largest cached blocks first, a chunk more at most") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  auto a = Member::growable(device, dir.table());
  auto b = Member::growable(device, dir.table());
  a->share->start();
  b->share->start();
  Block* kept = a->alloc.malloc(1 * GiB, kStream0);
  Block* small_cache = a->alloc.malloc(8 * GiB, kStream0);
  Block* between = a->alloc.malloc(1 * GiB, kStream0);
  a->alloc.free(a->alloc.malloc(80 * GiB, kStream0));
  a->alloc.free(small_cache);
  REQUIRE(a->alloc.reserved() >= 90 * GiB);
  const std::size_t a_before = a->alloc.reserved();
  const std::size_t free_before = b->backend.mem_info(0).free;
  REQUIRE(free_before < 60 * GiB);

  Block* big = b->alloc.malloc(60 * GiB, kStream0);
  CHECK(big->size >= 60 * GiB);
  const std::size_t lacked = b->alloc.reserved() - free_before;  // what B mapped beyond the free device
  const std::size_t given = status_once_served(*a->share).given_back;
  CHECK(given >= lacked);
  CHECK(given <= lacked + GrowableSegments::kMaxChunk);
  CHECK(a_before - a->alloc.reserved() == given);
  // From the 80 GiB block: the 8 GiB one stays cached, as do the live ones.
  CHECK(a->alloc.reserved() >= 8 * GiB + 2 * GiB);
  CHECK(kept->allocated);
  CHECK(between->allocated);
  a->alloc.check_invariants();
  b->alloc.check_invariants();
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: while the asked member releases, the asker maps what the device holds, and ends on the rest") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  auto a = Member::growable(device, dir.table());  // answers only when the test says (no responder)
  auto b = Member::growable(device, dir.table());
  a->alloc.free(a->alloc.malloc(100 * GiB, kStream0));
  a->share->follow_now();  // its figures published, as its responder's round would
  const std::size_t free_before = b->backend.mem_info(0).free;
  REQUIRE(free_before == 40 * GiB);

  std::atomic<Block*> got{nullptr};
  std::thread request([&] { got = b->alloc.malloc(60 * GiB, kStream0); });
  // B maps what the device holds while A has not answered yet: whole chunks of the growth.
  std::size_t ahead = 0;
  for (int i = 0; i < 20000 && ahead < free_before - GrowableSegments::kMaxChunk; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ahead = b->alloc.reserved();
  }
  CHECK(ahead >= free_before - GrowableSegments::kMaxChunk);
  CHECK(ahead <= free_before);
  CHECK(got.load() == nullptr);
  a->share->follow_now();  // A answers: it gives back what B lacks
  request.join();
  REQUIRE(got.load() != nullptr);
  CHECK(got.load()->size >= 60 * GiB);
  CHECK(status_once_served(*a->share).given_back <= 60 * GiB - ahead + 2 * GrowableSegments::kMaxChunk);
  CHECK(a->alloc.reserved() >= 100 * GiB - (60 * GiB - ahead) - 2 * GrowableSegments::kMaxChunk);
  b->alloc.check_invariants();
  CHECK(b->alloc.reserved() < 60 * GiB + GrowableSegments::kMaxChunk);  // one growth, not two
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: a member asked just after it freed its tensors is handed over from while it releases") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  auto a = Member::growable(device, dir.table());
  auto b = Member::growable(device, dir.table());
  Block* big = a->alloc.malloc(100 * GiB, kStream0);
  a->share->follow_now();  // published: 100 GiB in use, nothing cached
  a->alloc.free(big);      // cached now; its figures in the table are a round old
  const std::size_t free_before = b->backend.mem_info(0).free;
  REQUIRE(free_before == 40 * GiB);
  // A's first unmap waits (5 s at most) for B to map what the device holds: B must have read A's
  // fresh figures while A releases, since the figures it asked from said A cached nothing.
  std::atomic<bool> held{false};
  std::atomic<std::size_t> b_during{0};
  a->backend.before_unmap = [&] {
    if (held.exchange(true)) return;
    for (int i = 0; i < 20000 && b->alloc.reserved() < free_before - GrowableSegments::kMaxChunk; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    b_during = b->alloc.reserved();
  };
  a->share->start();
  Block* got = b->alloc.malloc(60 * GiB, kStream0);
  REQUIRE(got != nullptr);
  CHECK(got->size >= 60 * GiB);
  CHECK(held.load());
  CHECK(b_during.load() >= free_before - GrowableSegments::kMaxChunk);
  CHECK(status_once_served(*a->share).given_back <= 60 * GiB - free_before + 2 * GrowableSegments::kMaxChunk);
  CHECK(b->alloc.reserved() < 60 * GiB + GrowableSegments::kMaxChunk);  // one growth, not two
  b->alloc.check_invariants();
  CHECK(device.peak.load() <= device.capacity);
  a->share->stop();
}

TEST_CASE("sharing: where the others' cache cannot hold what the device lacks, nothing is mapped ahead") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  auto a = Member::growable(device, dir.table());
  auto b = Member::growable(device, dir.table());
  a->share->start();
  Block* live = a->alloc.malloc(90 * GiB, kStream0);
  a->alloc.free(a->alloc.malloc(10 * GiB, kStream0));
  a->share->follow_now();
  // B lacks 20 GiB of the device for 60 GiB; A caches 10: B's request fails at once, and B holds
  // nothing it mapped for it (no memory passed to and fro between askers).
  CHECK_THROWS_AS(b->alloc.malloc(60 * GiB, kStream0), OutOfMemoryError);
  CHECK(b->alloc.reserved() == 0);
  CHECK(b->backend.ledger(0).maps == 0);
  CHECK(live->allocated);
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: a request with caching off asks the others too when the device refuses it") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Member a(device, dir.table()), b(device, dir.table());
  a.share->start();
  b.share->start();
  a.alloc.free(a.alloc.malloc(100 * GiB, kStream0));
  REQUIRE(a.alloc.reserved() == 100 * GiB);
  void* big = b.alloc.malloc_uncached(60 * GiB);
  CHECK(big != nullptr);
  CHECK(status_once_served(*a.share).given_back == 100 * GiB);
  CHECK(a.alloc.reserved() == 0);
  CHECK(b.alloc.free_uncached(big));
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: a device refusal with nobody to ask fails as before, and names the sharing") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Member alone(device, dir.table());
  device.take(6 * GiB);  // a native process
  const Oom oom = oom_from([&] { alone.alloc.malloc(4 * GiB, kStream0); });
  CHECK(oom.info.kind == OomKind::kDeviceFull);
  CHECK_THAT(oom.message, Catch::Contains("no other gpumem process"));
  CHECK_THAT(oom.message, Catch::Contains("could not be asked"));
}

TEST_CASE("sharing: the out-of-memory message names, by pid, the processes the driver lists that could not be asked") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Member a(device, dir.table()), b(device, dir.table());  // both this process: the table's pids are live ones
  a.share->start();
  b.share->start();
  Block* held = b.alloc.malloc(1 * GiB, kStream0);
  device.take(6 * GiB);  // a native process, pid 4242
  const auto me = static_cast<std::uint32_t>(::getpid());
  a.backend.set_processes(0, {{me, 1 * GiB + 512 * MiB}, {4242, 6 * GiB}});
  const Oom oom = oom_from([&] { a.alloc.malloc(2 * GiB, kStream0); });
  CHECK(oom.info.kind == OomKind::kDeviceFull);
  const std::string member = "pid " + std::to_string(me);
  CHECK_THAT(oom.message, Catch::Contains(member + " reserves 1.00 GiB"));  // a member: asked
  CHECK_THAT(oom.message, Catch::Contains("not asked"));
  CHECK_THAT(oom.message, Catch::Contains("pid 4242 holds 6.00 GiB"));
  CHECK_THAT(oom.message, !Catch::Contains(member + " holds"));  // members are not listed as not asked
  b.alloc.free(held);
}

TEST_CASE("sharing: the others stop short of a floor not yet used, and its owner gets it") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Member s(device, dir.table()), t(device, dir.table());
  s.share->start();
  t.share->start();
  CHECK(s.share->set_floor(20 * GiB).short_now == 0);
  Block* used = s.alloc.malloc(2 * GiB, kStream0);
  s.share->follow_now();  // its figures published now, not at the responder's next round
  std::size_t grown = 0;
  const Oom oom = oom_from([&] {
    for (;;) {
      t.alloc.malloc(1 * GiB, kStream0);
      grown += GiB;
    }
  });
  CHECK(oom.info.kind == OomKind::kOverLimit);  // the ceiling, not the device, refused
  CHECK(oom.info.neighbours);                   // and says the others' floor, not the limit, did
  CHECK(t.alloc.reserved() == 120 * GiB);       // 140 less S's floor
  CHECK(grown == 120 * GiB);
  CHECK_THAT(oom.message, Catch::Contains("floor 20.00 GiB"));
  CHECK_THAT(oom.message, Catch::Contains("raising it cannot help"));
  CHECK_THAT(oom.message, !Catch::Contains("raise it with gpumem.set_limit()"));
  Block* rest = s.alloc.malloc(18 * GiB, kStream0);  // up to its floor
  CHECK(rest->allocated);
  CHECK(used->allocated);
  CHECK(device.in_use.load() == 140 * GiB);
}

TEST_CASE("sharing: a borrower gives back cache when a floor comes back, keeps its tensors, and stops growing") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Member t(device, dir.table()), s(device, dir.table());
  std::vector<Block*> live;
  for (int i = 0; i < 100; ++i) live.push_back(t.alloc.malloc(1 * GiB, kStream0));
  std::vector<Block*> cache;
  for (int i = 0; i < 30; ++i) cache.push_back(t.alloc.malloc(1 * GiB, kStream0));
  for (Block* b : cache) t.alloc.free(b);
  REQUIRE(t.alloc.reserved() == 130 * GiB);
  t.share->follow_now();
  t.share->start();
  s.share->start();

  CHECK(s.share->set_floor(20 * GiB).short_now == 0);  // honourable: T's cache can go
  Block* floor = s.alloc.malloc(20 * GiB, kStream0);  // the device refuses at first; T is asked
  CHECK(floor->allocated);
  CHECK(t.alloc.reserved() <= 120 * GiB);
  CHECK(allocated(t.alloc) == 100 * GiB);
  for (Block* b : live) CHECK(b->allocated);
  CHECK_THROWS_AS(t.alloc.malloc(21 * GiB, kStream0), OutOfMemoryError);
  CHECK(t.alloc.reserved() <= 120 * GiB);
  t.alloc.check_invariants();
}

TEST_CASE("sharing: a floor others' live tensors hold is reported short, and honoured as they free") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(100 * GiB);
  Member t(device, dir.table()), s(device, dir.table());
  std::vector<Block*> live;
  for (int i = 0; i < 90; ++i) live.push_back(t.alloc.malloc(1 * GiB, kStream0));
  t.share->follow_now();
  t.share->start();
  s.share->start();
  CHECK(s.share->set_floor(20 * GiB).short_now == 10 * GiB);
  CHECK(s.share->status().floor_short == 10 * GiB);
  for (int i = 0; i < 15; ++i) t.alloc.free(live[i]);  // 75 GiB live now; the frees give back
  Block* got = s.alloc.malloc(20 * GiB, kStream0);
  CHECK(got->allocated);
  CHECK(s.share->status().floor_short == 0);
  CHECK_THROWS_AS(t.alloc.malloc(10 * GiB, kStream0), OutOfMemoryError);  // 75 + 20 + 10 > 100
}

TEST_CASE("sharing: the hard cap stays exact and the members never hold more than the device") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(64 * GiB);
  Member a(device, dir.table(), 40 * GiB), b(device, dir.table(), 40 * GiB);
  a.share->start();
  b.share->start();
  CHECK(a.share->set_floor(8 * GiB).short_now == 0);
  std::mt19937 rng(29);
  std::vector<Block*> held[2];
  Member* members[2] = {&a, &b};
  for (int step = 0; step < 400; ++step) {
    const int who = static_cast<int>(rng() % 2);
    Member& m = *members[who];
    if (!held[who].empty() && rng() % 3 == 0) {
      const std::size_t i = rng() % held[who].size();
      m.alloc.free(held[who][i]);
      held[who].erase(held[who].begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      try {
        held[who].push_back(m.alloc.malloc((1 + rng() % 2048) * MiB, kStream0));
      } catch (const OutOfMemoryError&) {
      }
    }
    CHECK(m.alloc.reserved() <= 40 * GiB);
    CHECK(m.backend.ledger(0).peak <= 40 * GiB);
  }
  CHECK(device.peak.load() <= device.capacity);
  a.alloc.check_invariants();
  b.alloc.check_invariants();
}

TEST_CASE("sharing: while a request asks the others, the rest of its process allocates and frees as usual") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  ShareOptions bounded = Member::test_options();
  bounded.ask_wait = std::chrono::milliseconds(3000);
  Member a(device, dir.table(), std::nullopt, 0, bounded);
  Member silent(device, dir.table());  // no responder: it never answers
  silent.alloc.free(silent.alloc.malloc(6 * GiB, kStream0));
  a.alloc.free(a.alloc.malloc(512 * MiB, kStream1));  // cached on another stream
  ShareTable watcher(dir.table());
  const std::uint32_t silent_slot = silent.share->slot_index();
  std::atomic<bool> ended{false};
  std::thread asker([&] {
    try {
      a.alloc.malloc(4 * GiB, kStream0);  // the device refuses: the silent member is asked
    } catch (const OutOfMemoryError&) {
    }
    ended = true;
  });
  wait_until_asked(watcher, silent_slot);
  Block* cached = a.alloc.malloc(512 * MiB, kStream1);  // its lane, or the whole device
  a.alloc.free(cached);
  Block* fresh = a.alloc.malloc(256 * MiB, kStream2);  // new memory: the whole device
  a.alloc.free(fresh);
  CHECK_FALSE(ended.load());  // all of it done while the ask still waits for the silent member
  asker.join();
  CHECK(a.share->status().asks_timed_out == 1);
}

TEST_CASE("sharing: two members asking each other at once both end, neither waiting out the bound") {
  for (int round = 0; round < 8; ++round) {
    TempDir dir;
    SharedDevice& device = SharedDevice::make(10 * GiB);
    Member a(device, dir.table()), b(device, dir.table());
    a.share->start();
    b.share->start();
    Block* a_live = a.alloc.malloc(6 * GiB, kStream0);
    Block* b_live = b.alloc.malloc(3 * GiB, kStream0);
    b.alloc.free(b.alloc.malloc(1 * GiB, kStream0));  // 1 GiB of b's cache: the device is full
    std::atomic<int> ready{0};
    auto request = [&](Member& m) {
      ++ready;
      while (ready.load() < 2) {}
      try {
        m.alloc.free(m.alloc.malloc(2 * GiB, kStream1));
      } catch (const OutOfMemoryError& error) {
        CHECK(error.info().kind == OomKind::kDeviceFull);
      }
    };
    std::thread ta([&] { request(a); }), tb([&] { request(b); });
    ta.join();
    tb.join();
    // Each was answered: an ask that held its own device while the other's answer needed it would
    // have waited out the bound (20 s here) and counted it.
    CHECK(a.share->status().asks_timed_out == 0);
    CHECK(b.share->status().asks_timed_out == 0);
    CHECK(a_live->allocated);
    CHECK(b_live->allocated);
    CHECK(device.peak.load() <= device.capacity);
  }
}

TEST_CASE("sharing: floors add up: a second floor gets what the first leaves, and is told who holds it") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Member a(device, dir.table(), std::nullopt, 1111), b(device, dir.table(), std::nullopt, 2222);
  a.share->start();
  b.share->start();
  CHECK(a.share->set_floor(6 * GiB).granted == 6 * GiB);
  const FloorGrant grant = b.share->set_floor(6 * GiB);
  CHECK(grant.asked == 6 * GiB);
  CHECK(grant.granted == 2 * GiB);
  REQUIRE(grant.floor_holders.size() == 1);
  CHECK(grant.floor_holders[0].pid == 1111);
  CHECK(grant.floor_holders[0].floor == 6 * GiB);
  CHECK(b.share->floor() == 2 * GiB);
  Block* fa = a.alloc.malloc(6 * GiB, kStream0);  // both floors can be used at once
  Block* fb = b.alloc.malloc(2 * GiB, kStream0);
  CHECK(fa->allocated);
  CHECK(fb->allocated);
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing: a writer cannot silence a member by answering for it, nor erase its floor for good") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Member a(device, dir.table()), b(device, dir.table());
  a.share->set_floor(1 * GiB);
  a.alloc.free(a.alloc.malloc(4 * GiB, kStream0));  // cache to give back
  a.share->start();
  const ShareLayout layout = share_layout();
  auto field = [&](const char* name) {
    for (const auto& [n, offset] : layout.fields) {
      if (n == name) return layout.header_bytes + a.share->slot_index() * layout.slot_bytes + offset;
    }
    FAIL("no field " << name);
    return std::size_t{0};
  };
  const int fd = ::open(dir.table().c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  std::uint32_t asks = 0;
  REQUIRE(::pread(fd, &asks, 4, static_cast<off_t>(field("asks"))) == 4);
  const std::uint32_t ahead = asks + 100;
  REQUIRE(::pwrite(fd, &ahead, 4, static_cast<off_t>(field("served"))) == 4);
  b.share->ask_others();
  for (int i = 0; i < 20000 && a.alloc.reserved() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(a.alloc.reserved() == 0);  // it answered: its cache went back
  CHECK(status_once_served(*a.share).given_back == 4 * GiB);
  const std::uint64_t zero = 0;
  REQUIRE(::pwrite(fd, &zero, 8, static_cast<off_t>(field("floor"))) == 8);
  std::uint64_t floor = 0;
  for (int i = 0; i < 20000 && floor != 1 * GiB; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(::pread(fd, &floor, 8, static_cast<off_t>(field("floor"))) == 8);
  }
  CHECK(floor == 1 * GiB);  // its owner wrote it again
  ::close(fd);
}

TEST_CASE("sharing: a table cut under its members is rejoined, their floors granted again so that they still add up") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Member a(device, dir.table()), b(device, dir.table());
  CHECK(a.share->set_floor(6 * GiB).granted == 6 * GiB);
  CHECK(b.share->set_floor(6 * GiB).granted == 2 * GiB);
  REQUIRE(::truncate(dir.table().c_str(), 0) == 0);
  b.share->follow_now();  // b rejoins first: it may now be granted what it asked for
  a.share->follow_now();
  CHECK(b.share->status().problem.empty());
  CHECK(a.share->status().problem.empty());
  CHECK(a.share->floor() + b.share->floor() <= 8 * GiB);
  CHECK(b.share->floor() == 6 * GiB);
  CHECK(a.share->floor() == 2 * GiB);
  REQUIRE(a.share->status().others.size() == 1);  // they see each other again
  CHECK(a.share->status().others[0].floor == 6 * GiB);
}

TEST_CASE("sharing: a child forked while its parent asks can let go of the sharing without waiting for that ask") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  ShareOptions bounded = Member::test_options();
  bounded.ask_wait = std::chrono::milliseconds(3000);
  Member a(device, dir.table(), std::nullopt, 0, bounded);
  Member silent(device, dir.table());  // never answers
  silent.alloc.free(silent.alloc.malloc(7 * GiB, kStream0));
  ShareTable watcher(dir.table());
  const std::uint32_t silent_slot = silent.share->slot_index();
  std::thread asker([&] {
    try {
      a.alloc.malloc(4 * GiB, kStream0);
    } catch (const OutOfMemoryError&) {
    }
  });
  wait_until_asked(watcher, silent_slot);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(20);                  // a wait for the parent's ask would never end here
    a.alloc.set_share(nullptr);   // as the child's own leave does
    ::_exit(7);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 7);
  asker.join();
}

// ---- the protocol, forked processes ----

// A pipe to say one byte and to wait for it.
struct Pipe {
  int fd[2];
  Pipe() { REQUIRE(::pipe(fd) == 0); }
  void say(char c) const { (void)!::write(fd[1], &c, 1); }
  char hear() const {
    char c = 0;
    while (::read(fd[0], &c, 1) < 0 && errno == EINTR) {}
    return c;
  }
};

TEST_CASE("sharing across processes: another process's cache goes back for this one's request") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Pipe ready, go, done;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    char ok = 'n';
    try {
      Member a(device, dir.table());
      a.share->start();
      Block* kept = a.alloc.malloc(1 * GiB, kStream0);
      a.alloc.free(a.alloc.malloc(100 * GiB, kStream0));
      ready.say('r');
      go.hear();
      Block* more = a.alloc.malloc(10 * GiB, kStream0);
      // The asker maps while this process still releases (Note [handing memory over while it is
      // released]): the answer counts what it gave back once the release has ended.
      for (int i = 0; i < 1000 && a.share->status().given_back < 100 * GiB; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ok = kept->allocated && more->allocated && a.alloc.reserved() == 11 * GiB && a.share->status().given_back == 100 * GiB
               ? 'y'
               : 'n';
    } catch (...) {
    }
    done.say(ok);
    ::_exit(0);
  }
  ready.hear();
  {
    Member b(device, dir.table());
    b.share->start();
    Block* big = b.alloc.malloc(60 * GiB, kStream0);
    CHECK(big->allocated);
    go.say('g');
    CHECK(done.hear() == 'y');
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(device.peak.load() <= device.capacity);
}

TEST_CASE("sharing across processes: a process killed while it is asked blocks nobody, and its floor goes") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(140 * GiB);
  Pipe ready;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    Member a(device, dir.table());  // no responder: it never answers
    a.share->set_floor(10 * GiB);
    a.alloc.free(a.alloc.malloc(100 * GiB, kStream0));
    ready.say('r');
    ::pause();
    ::_exit(0);
  }
  ready.hear();
  Member b(device, dir.table());
  ShareTable watcher(dir.table());
  // The killer: once the child has been asked, it dies, and the driver frees what it held.
  std::thread killer([&] {
    for (;;) {
      bool asked = false;
      std::vector<SlotCopy> seen;
      watcher.read_others(ShareTable::kSlots, 140 * GiB, seen);
      for (const SlotCopy& c : seen) {
        if (c.pid == static_cast<std::uint32_t>(child) && c.asks != c.served) asked = true;
      }
      if (asked) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    device.give(100 * GiB);  // the driver frees a dead process's memory as it dies
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
  });
  Block* big = nullptr;
  try {
    big = b.alloc.malloc(60 * GiB, kStream0);
  } catch (const OutOfMemoryError&) {
  }
  killer.join();
  REQUIRE(big != nullptr);
  CHECK(big->allocated);
  CHECK(b.share->status().others.empty());
  Block* all = b.alloc.malloc(79 * GiB, kStream0);  // the dead floor no longer holds 10 GiB back
  CHECK(all->allocated);
}

TEST_CASE("sharing across processes: a forked child is not a member: its exit leaves its parent's slot, and the parent's death frees it while the child lives") {
  TempDir dir;
  SharedDevice& device = SharedDevice::make(8 * GiB);
  Pipe ready, sleeper_pid;
  const pid_t parent = ::fork();
  REQUIRE(parent >= 0);
  if (parent == 0) {
    Member p(device, dir.table());
    p.share->start();
    p.share->set_floor(2 * GiB);
    const pid_t leaving = ::fork();
    if (leaving == 0) {
      p.alloc.set_share(nullptr);
      p.share.reset();  // the child's copy goes, as at its normal exit
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(leaving, &status, 0);
    Pipe forked;
    const pid_t sleeper = ::fork();
    if (sleeper == 0) {
      forked.say('f');  // past fork(): its handlers ran in this child
      ::pause();
      ::_exit(0);
    }
    forked.hear();
    (void)!::write(sleeper_pid.fd[1], &sleeper, sizeof sleeper);
    ready.say('r');
    ::pause();
    ::_exit(0);
  }
  ready.hear();
  pid_t sleeper = 0;
  REQUIRE(::read(sleeper_pid.fd[0], &sleeper, sizeof sleeper) == sizeof sleeper);
  ShareTable watcher(dir.table());
  std::vector<SlotCopy> seen;
  REQUIRE(watcher.read_others(ShareTable::kSlots, 8 * GiB, seen));
  REQUIRE(seen.size() == 1);  // the parent, after its child left
  CHECK(seen[0].pid == static_cast<std::uint32_t>(parent));
  CHECK(seen[0].floor == 2 * GiB);
  ::kill(parent, SIGKILL);
  int status = 0;
  ::waitpid(parent, &status, 0);
  CHECK(::kill(sleeper, 0) == 0);  // the child that inherited its descriptors lives on
  REQUIRE(watcher.read_others(ShareTable::kSlots, 8 * GiB, seen));
  CHECK(seen.empty());
  ::kill(sleeper, SIGKILL);
}

}  // namespace
}  // namespace gpumem_test
