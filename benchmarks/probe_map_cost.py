import time, json, torch, gpumem
gpumem.enable()
torch.empty(1, device="cuda"); torch.cuda.synchronize()
out = {"segments": gpumem.get_segments()}
for gib in (1, 4):
    n = gib << 30
    t = time.perf_counter(); x = torch.empty(n, dtype=torch.uint8, device="cuda"); t_map = time.perf_counter() - t
    del x
    t = time.perf_counter(); torch.cuda.empty_cache(); t_unmap = time.perf_counter() - t
    pages = n // (2 << 20)
    out[f"{gib}GiB"] = {"map_us_per_page": t_map / pages * 1e6, "unmap_us_per_page": t_unmap / pages * 1e6}
print(json.dumps(out))
