// The core's public face: what a user of the core library (gpumem_core) includes, and the only core
// header the Python module (csrc/python/module.cpp) may include (tools/check_layers.py checks it).
//   CachingAllocator, DeviceAllocator, DeviceStats   core/caching_allocator.h (and the headers it brings)
//   the limit grammar: parse_limit, LimitSpecError    core/limit_spec.h
//   sizes: format_bytes, the size classes             core/sizing.h
//   typed errors: OutOfMemoryError, DeviceError       core/errors.h
//   pressure watches and their crossings              core/pressure.h
// A backend (core/backend.h) is given to CachingAllocator from outside: the CUDA one
// (backends/cuda_backend.h) or the simulated device (backends/sim_backend.h), each a library of its own.
#pragma once

#include "core/caching_allocator.h"
#include "core/errors.h"
#include "core/limit_spec.h"
#include "core/pressure.h"
#include "core/sizing.h"
