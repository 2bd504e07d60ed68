// A Backend that reports segment reserves and releases to the History (segment_alloc /
// segment_free trace entries, which torch's memory viewer and trace trackers use), and the pages
// growable segments map and unmap (segment_map / segment_unmap, as torch's expandable segments
// report them), then forwards to the real backend. Address ranges hold no memory and are not
// reported. The core does not know it is watched. Memory is reserved and mapped only on the slow
// path, so the extra virtual call costs nothing that matters. It overrides every call of Backend:
// one left out would reach Backend's default (which refuses), never the real backend.
#pragma once

#include "core/backend.h"
#include "torch/history.h"

namespace gpumem {

class TracingBackend final : public Backend {
 public:
  TracingBackend(Backend& inner, History& history) : inner_(inner), history_(history) {}

  // The request the calling thread is serving, for the segment entries it causes: its stream and
  // the stack gathered for it (segments remember the stack that made them). The adapter opens one
  // around each call into the core while history is active; closing it drops the stack.
  class Request {
   public:
    Request(StreamId stream, History::Context context);
    ~Request();
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
  };

  int device_count() const override { return inner_.device_count(); }
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  MemInfo mem_info(int device) override { return inner_.mem_info(device); }
  std::size_t total_memory(int device) override { return inner_.total_memory(device); }
  std::optional<std::size_t> process_used(int device) override { return inner_.process_used(device); }
  EventId record_event(int device, StreamId stream) override { return inner_.record_event(device, stream); }
  bool event_done(int device, EventId event) override { return inner_.event_done(device, event); }
  void destroy_event(int device, EventId event) override { inner_.destroy_event(device, event); }
  void synchronize(int device) override { inner_.synchronize(device); }
  void synchronize_stream(int device, StreamId stream) override { inner_.synchronize_stream(device, stream); }

  std::size_t page_size(int device) override { return inner_.page_size(device); }
  void* reserve_address(int device, std::size_t bytes) override { return inner_.reserve_address(device, bytes); }
  void release_address(int device, void* ptr, std::size_t bytes) override {
    inner_.release_address(device, ptr, bytes);
  }
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override;
  void unmap(int device, void* ptr, std::size_t bytes) override;
  void grant_peer(int device, int peer) override { inner_.grant_peer(device, peer); }
  void back_up(int device, std::vector<HostCopy>& copies) override { inner_.back_up(device, copies); }
  void restore(int device, const std::vector<HostCopy>& copies) override { inner_.restore(device, copies); }
  void drop_backup(int device, std::vector<HostCopy>& copies) noexcept override { inner_.drop_backup(device, copies); }
  CaptureMarker capture_marker(int device, StreamId stream) override { return inner_.capture_marker(device, stream); }
  bool capture_follows(int device, StreamId stream, CaptureMarker marker) override {
    return inner_.capture_follows(device, stream, marker);
  }
  std::string export_segment(int device, void* base) override { return inner_.export_segment(device, base); }
  void* open_segment(int device, const std::string& handle) override { return inner_.open_segment(device, handle); }
  void close_segment(int device, void* ptr) override { inner_.close_segment(device, ptr); }
  std::vector<int> export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) override {
    return inner_.export_chunks(device, chunks);
  }
  void* open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) override {
    return inner_.open_chunks(device, pid, fds, bytes);
  }
  void close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) override { inner_.close_chunks(device, ptr, bytes); }

 private:
  Backend& inner_;
  History& history_;
};

}  // namespace gpumem
