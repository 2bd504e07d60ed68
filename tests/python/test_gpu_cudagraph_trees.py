"""Checkpoints of a CUDA graph's private pool, as torch.compile(mode="reduce-overhead") takes and
restores them when it re-records while outputs of earlier graphs are alive.

Each pattern: capture a function into a pool, save the pool's state, change it, restore it, and
check that the pool's segments and blocks are what they were, that tensors alive across the restore
free their memory when they die, and that nothing crashes. Each test runs in a fresh process.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Helpers every snippet starts with: a function captured into a graph, the layout of a pool.
HELPERS = """
import gc

def captured(fn, pool=None):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        outputs = fn()
    return graph, list(outputs)

def layout(pool):
    segments = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) == tuple(pool)]
    return sorted((s["address"], s["total_size"], [(b["size"], b["state"]) for b in s["blocks"]]) for s in segments)

def allocated_in(pool):
    return sum(b[0] for _, _, blocks in layout(pool) for b in blocks if b[1] == "active_allocated")

def restore(pool, state, deleters=()):
    torch._C._cuda_setCheckpointPoolState(0, state, [], [s._cdata for s in deleters])

def u8(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")
"""

KiB, MiB = 1 << 10, 1 << 20


def run_pattern(run_python, body):
    return run_python('gpumem.set_limit("8GB")', HELPERS, body)


def test_several_live_outputs_are_restored_at_their_addresses_and_free_when_they_die(run_python):
    result = run_pattern(run_python, """
        def fn():
            x = u8(4096) + 1
            return x, u8(1024) + u8(1024), u8(3 << 20) * 2, u8(512)
        graph, outs = captured(fn)
        pool = graph.pool()
        before = layout(pool)
        restore(pool, torch._C._cuda_getCheckpointState(0, pool))
        after = layout(pool)
        held = allocated_in(pool)
        del outs
        gc.collect()
        print(json.dumps({"same": before == after, "held": held, "left": allocated_in(pool)}))
    """)
    assert result["same"]
    assert result["held"] > 0
    assert result["left"] == 0


def test_a_live_block_in_the_middle_of_a_segment_is_restored(run_python):
    result = run_pattern(run_python, """
        def fn():
            a, b, c = u8(100 * 1024), u8(100 * 1024), u8(100 * 1024)
            return (b + 1,)
        graph, outs = captured(fn)
        pool = graph.pool()
        before = layout(pool)
        restore(pool, torch._C._cuda_getCheckpointState(0, pool))
        same = before == layout(pool)
        del outs
        print(json.dumps({"same": same, "left": allocated_in(pool)}))
    """)
    assert result == {"same": True, "left": 0}


def test_contiguous_live_blocks_in_the_middle_are_restored(run_python):
    result = run_pattern(run_python, """
        def fn():
            blocks = [u8(64 * 1024) for _ in range(6)]
            return blocks[2] + 1, blocks[3] + 1, blocks[4] + 1
        graph, outs = captured(fn)
        pool = graph.pool()
        before = layout(pool)
        restore(pool, torch._C._cuda_getCheckpointState(0, pool))
        same = before == layout(pool)
        outs.pop(1)
        middle_freed = allocated_in(pool)
        del outs
        print(json.dumps({"same": same, "middle_freed": middle_freed, "left": allocated_in(pool)}))
    """)
    assert result["same"]
    assert result["middle_freed"] > 0
    assert result["left"] == 0


def test_a_tensor_that_died_after_the_checkpoint_comes_back_and_is_freed_by_address(run_python):
    result = run_pattern(run_python, """
        def fn():
            return u8(1 << 20) + 1, u8(1 << 20) + 2, u8(5 << 20) + 3
        graph, outs = captured(fn)
        pool = graph.pool()
        state = torch._C._cuda_getCheckpointState(0, pool)
        before = layout(pool)
        dead = outs.pop(1).data_ptr()
        restore(pool, state)
        same = before == layout(pool)
        torch._C._cuda_cudaCachingAllocator_raw_delete(dead)  # what cudagraph trees do with dead outputs
        after_raw_delete = allocated_in(pool)
        # An extra free of a tensor that was alive at the checkpoint, after the restore.
        outs.pop(0)
        after_extra = allocated_in(pool)
        del outs
        print(json.dumps({"same": same, "raw": after_raw_delete, "extra": after_extra, "left": allocated_in(pool)}))
    """)
    assert result["same"]
    assert result["raw"] > result["extra"] > result["left"] == 0


def test_storages_named_for_deleters_take_the_restored_blocks_and_free_them(run_python):
    result = run_pattern(run_python, """
        def fn():
            return (u8(2 << 20) + 1,)
        graph, outs = captured(fn)
        pool = graph.pool()
        state = torch._C._cuda_getCheckpointState(0, pool)
        out = outs.pop()
        ptr, nbytes = out.data_ptr(), out.untyped_storage().nbytes()
        # cudagraph trees free a live output's memory and rebuild its storage without a deleter.
        torch._C._free_And_Remove_DeleterFn(out.untyped_storage()._cdata)
        rebuilt = torch._C._construct_storage_from_data_pointer(ptr, out.device, nbytes)
        restore(pool, state, deleters=[rebuilt])
        standard = torch._C._has_Standard_Deleter(rebuilt._cdata)
        held = allocated_in(pool)
        del rebuilt, out
        gc.collect()
        print(json.dumps({"standard": standard, "held": held, "left": allocated_in(pool)}))
    """)
    assert result["standard"]
    assert result["held"] >= 2 * MiB
    assert result["left"] == 0


def test_a_restore_gpumem_refuses_is_a_runtime_error_that_changes_nothing(run_python):
    result = run_pattern(run_python, """
        def fn():
            return u8(1 << 20) + 1, u8(1 << 20) + 2
        graph, outs = captured(fn)
        pool = graph.pool()
        state = torch._C._cuda_getCheckpointState(0, pool)
        outs[0].record_stream(torch.cuda.Stream())  # a live block also used on another stream
        before = layout(pool)
        try:
            restore(pool, state)
            error = None
        except RuntimeError as e:
            error = str(e)
        unchanged = before == layout(pool)
        outs.clear()
        torch.cuda.synchronize()
        gc.collect()
        print(json.dumps({"error": error, "unchanged": unchanged, "left": allocated_in(pool)}))
    """)
    assert "another stream" in result["error"]
    assert result["unchanged"]
    assert result["left"] == 0


def test_a_resnet_forward_captured_in_a_graph_is_restored_and_replays_as_eager(run_python):
    torchvision = pytest.importorskip("torchvision")
    del torchvision
    result = run_pattern(run_python, """
        import torchvision
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = False
        model = torchvision.models.resnet18().cuda().eval()
        static_in = torch.randn(8, 3, 64, 64, device="cuda")
        with torch.no_grad():
            graph, outs = captured(lambda: (model(static_in),))
            pool = graph.pool()
            before = layout(pool)
            restore(pool, torch._C._cuda_getCheckpointState(0, pool))
            same = before == layout(pool)
            fresh = torch.randn(8, 3, 64, 64, device="cuda")
            static_in.copy_(fresh)
            graph.replay()
            error = (outs[0] - model(fresh)).abs().max().item()
        del outs
        gc.collect()
        print(json.dumps({"same": same, "error": error, "left": allocated_in(pool),
                          "segments": len(before)}))
    """)
    assert result["same"]
    assert result["segments"] > 0
    assert result["error"] < 1e-3
    assert result["left"] == 0


def test_compiled_training_that_re_records_for_changing_shapes_matches_eager_under_a_cap(run_python):
    result = run_python(
        """
        import torch.nn.functional as F
        gpumem.set_limit("1GB")
        torch.backends.cuda.matmul.allow_tf32 = False
        restores = 0
        real_restore = torch._C._cuda_setCheckpointPoolState
        def counting_restore(*args):
            global restores
            restores += 1
            return real_restore(*args)
        torch._C._cuda_setCheckpointPoolState = counting_restore

        class Encoder(torch.nn.Module):  # a fixed-size context batch: replayed once recorded
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(256, 256)
            def forward(self, m):
                return torch.relu(self.linear(m)).mean(0, keepdim=True)

        class Head(torch.nn.Module):  # the batch whose size changes: new shapes are recorded
            def __init__(self):     # while the encoder's replayed outputs are alive
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
            def forward(self, x, context):
                return self.net(torch.cat([x, context.expand(x.shape[0], -1)], 1))

        def make():
            torch.manual_seed(0)
            return Encoder().cuda(), Head().cuda()
        runs = []
        for compiled in (False, True):
            encoder, head = make()
            params = list(encoder.parameters()) + list(head.parameters())
            if compiled:
                encoder = torch.compile(encoder, mode="reduce-overhead", dynamic=False)
                head = torch.compile(head, mode="reduce-overhead", dynamic=False)
            runs.append((encoder, head, torch.optim.SGD(params, lr=0.05), []))
        sizes = [16, 32, 48, 64, 24, 40]
        for step in range(100):
            n = sizes[min(step // 5, len(sizes) - 1)] if step < 40 else sizes[(step * 5) % len(sizes)]
            g = torch.Generator(device="cuda").manual_seed(step)
            m = torch.randn(64, 256, device="cuda", generator=g)
            x = torch.randn(n, 256, device="cuda", generator=g)
            y = torch.randint(0, 10, (n,), device="cuda", generator=g)
            for encoder, head, optimizer, losses in runs:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(head(x, encoder(m)), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        from torch._dynamo.utils import counters
        print(json.dumps({
            "diff": max(abs(a - b) for a, b in zip(runs[0][3], runs[1][3])),
            "steps": len(runs[1][3]),
            "restores": restores,
            "skips": counters["inductor"]["cudagraph_skips"],
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "limit": gpumem.get_limit(),
        }))
        """,
        timeout=900,
    )
    assert result["steps"] == 100, result
    assert result["skips"] == 0, f"torch.compile did not use CUDA graphs, so this tested nothing: {result}"
    assert result["restores"] > 0, f"no checkpoint was restored, so re-recording was not exercised: {result}"
    assert result["diff"] < 1e-3, result
    assert result["peak_reserved"] <= result["limit"], result
