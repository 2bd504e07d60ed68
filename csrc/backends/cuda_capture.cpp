// What a CUDA graph being captured says about stream order, for reusing a block freed during the
// capture while other streams used it (core/capture_reuse.cpp).
//
// A marker is an empty node added to the capture graph, depending on the nodes the stream's work
// ends in so far; the stream's later work is made to depend on it, so the marker stands for all
// of that stream's work up to now. A stream follows the marker once the marker is an ancestor of
// the nodes its next work will depend on: the capture joined the used stream back into it
// (cudaStreamWaitEvent, torch's wait_stream). Every call here is one the runtime allows during
// capture; a failure means "cannot tell", and the block then waits for the capture to end.
#include <cuda_runtime_api.h>

#include <unordered_set>
#include <vector>

#include "backends/cuda_backend.h"

namespace gpumem {

namespace {

struct Capture {
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* ends = nullptr;  // the nodes the stream's next work depends on
  std::size_t count = 0;
};

// The stream's capture, if it is being captured.
bool capture_of(cudaStream_t stream, Capture& out) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t error = cudaStreamGetCaptureInfo(stream, &status, &id, &out.graph, &out.ends, nullptr, &out.count);
#else
  const cudaError_t error = cudaStreamGetCaptureInfo(stream, &status, &id, &out.graph, &out.ends, &out.count);
#endif
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
}

bool dependencies_of(cudaGraphNode_t node, std::vector<cudaGraphNode_t>& out) {
  std::size_t count = 0;
#if CUDART_VERSION >= 13000
  cudaError_t error = cudaGraphNodeGetDependencies(node, nullptr, nullptr, &count);
  out.resize(count);
  if (error == cudaSuccess && count > 0) error = cudaGraphNodeGetDependencies(node, out.data(), nullptr, &count);
#else
  cudaError_t error = cudaGraphNodeGetDependencies(node, nullptr, &count);
  out.resize(count);
  if (error == cudaSuccess && count > 0) error = cudaGraphNodeGetDependencies(node, out.data(), &count);
#endif
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  out.resize(count);
  return true;
}

}  // namespace

CaptureMarker CudaBackend::capture_marker(int /*device*/, StreamId stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  Capture capture;
  if (!capture_of(s, capture)) return 0;
  cudaGraphNode_t marker = nullptr;
  if (cudaGraphAddEmptyNode(&marker, capture.graph, capture.ends, capture.count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
#if CUDART_VERSION >= 13000
  const cudaError_t error = cudaStreamUpdateCaptureDependencies(s, &marker, nullptr, 1, cudaStreamSetCaptureDependencies);
#else
  const cudaError_t error = cudaStreamUpdateCaptureDependencies(s, &marker, 1, cudaStreamSetCaptureDependencies);
#endif
  if (error != cudaSuccess) {
    // The node is in the graph but the stream's work does not follow it: it marks nothing.
    (void)cudaGetLastError();
    return 0;
  }
  return reinterpret_cast<CaptureMarker>(marker);
}

bool CudaBackend::capture_follows(int /*device*/, StreamId stream, CaptureMarker marker) {
  Capture capture;
  if (!capture_of(reinterpret_cast<cudaStream_t>(stream), capture)) return false;
  const auto wanted = reinterpret_cast<cudaGraphNode_t>(marker);
  std::vector<cudaGraphNode_t> todo(capture.ends, capture.ends + capture.count);
  std::unordered_set<cudaGraphNode_t> seen(todo.begin(), todo.end());
  std::vector<cudaGraphNode_t> deps;
  while (!todo.empty()) {
    const cudaGraphNode_t node = todo.back();
    todo.pop_back();
    if (node == wanted) return true;
    if (!dependencies_of(node, deps)) return false;
    for (cudaGraphNode_t dep : deps) {
      if (seen.insert(dep).second) todo.push_back(dep);
    }
  }
  return false;
}

}  // namespace gpumem
