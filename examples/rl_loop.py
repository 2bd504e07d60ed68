#!/usr/bin/env python3
"""An RL loop in one process: a rollout engine's memory is paused while the trainer steps.

    python3 examples/rl_loop.py [ROUNDS]      # default 10; needs a CUDA GPU

The process runs under a cap (half the device). The engine holds weights (a region with a backup:
their contents must survive) and a KV cache (a region without one: refilled at every rollout);
together they take 40 % of the cap. The trainer's step needs more than the cap leaves beside them,
so each round runs: resume the engine -> generate -> pause it -> one training step in the memory
it gave back. Each round checks that the engine's weights came back bit for bit, and prints one
JSON line; the last line sums the run up.
"""
import json
import sys

import torch

import gpumem

MiB = 1 << 20


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    gpumem.set_limit("50%")  # before any CUDA work: half of device 0
    limit = gpumem.get_limit()
    share = limit // 5  # the weights' bytes, and the KV cache's

    # The engine: weights kept across pauses, a KV cache dropped and refilled.
    width = 4096
    with gpumem.region("engine", backup=True):
        weights = torch.randn(share // 4 // width, width, device="cuda")
    with gpumem.region("kv_cache"):
        kv_cache = torch.empty(share // 4 // width, width, device="cuda")
    reference = weights.cpu()
    engine_bytes = 2 * share

    # The trainer: a model and Adam's state, and a step whose activations need most of the cap.
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    batch = int(0.55 * limit) // (width * 4 * 4)  # activations: about four floats per input element

    gpumem.pause()
    trainer_peaks = []
    for step in range(rounds):
        gpumem.resume()
        tokens = torch.randint(0, kv_cache.shape[0], (64,), device="cuda")
        kv_cache[tokens] = torch.tanh(kv_cache[tokens].zero_() + weights[tokens])  # "generate": fills the cache
        generated = float(kv_cache[tokens].sum())
        gpumem.pause()  # the engine's memory goes back; the weights to the host
        torch.cuda.reset_peak_memory_stats()
        x = torch.randn(batch, width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_reserved()
        trainer_peaks.append(peak)
        gpumem.resume("engine")
        intact = torch.equal(weights.cpu(), reference)
        gpumem.pause("engine")
        print(json.dumps({"round": step, "loss": round(float(loss), 4), "generated": round(generated, 2),
                          "trainer_peak_reserved": peak, "weights_intact": intact}), flush=True)
        if not intact:
            return 1
    gpumem.resume()
    print(json.dumps({"rounds": rounds, "limit": limit, "engine_bytes": engine_bytes,
                      "trainer_peak_reserved": max(trainer_peaks),
                      "trainer_peak_beside_a_resident_engine": max(trainer_peaks) + engine_bytes,
                      "weights_intact": torch.equal(weights.cpu(), reference)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
