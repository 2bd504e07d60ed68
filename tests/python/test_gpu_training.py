"""A real training loop under a gpumem cap. Each test runs in a fresh process (see run_python)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20

# A small transformer and one training step, shared by the snippets below.
MODEL = """
import random
import torch.nn as nn

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

def train_step(batch, seq):
    x = torch.randn(batch, seq, 256, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
"""


# Forty steps whose shapes change every step, so the cache fills with blocks of many sizes: left
# alone, plain segments reserve over 512 MB for a peak of about 430 MB allocated; growable ones
# stay within a few pages of the peak.
VARYING_LOOP = """
rng = random.Random(0)
reserved = []
for step in range(40):
    train_step(rng.choice([4, 8, 12, 16]), rng.choice([32, 64, 96, 128, 160, 192, 224, 256]))
    reserved.append(torch.cuda.memory_reserved())
print(json.dumps({
    "limit": gpumem.get_limit(),
    "reserved": reserved,
    "max_reserved": torch.cuda.max_memory_reserved(),
    "max_allocated": torch.cuda.max_memory_allocated(),
}))
"""


def test_a_training_loop_never_reserves_more_than_the_limit(run_python):
    uncapped = run_python('gpumem.set_segments("plain")', MODEL, VARYING_LOOP)
    capped = run_python('gpumem.set_segments("plain"); gpumem.set_limit("512MB")', MODEL, VARYING_LOOP)
    assert uncapped["max_reserved"] > 512 * MiB, "the loop fits under 512 MB uncapped, so the cap was never tested"
    assert uncapped["max_allocated"] < 512 * MiB
    assert capped["limit"] == 512 * MiB
    assert max(capped["reserved"]) <= capped["limit"]
    assert capped["max_reserved"] <= capped["limit"]


def test_growable_segments_train_under_a_cap_a_few_pages_above_the_peak_allocated(run_python):
    uncapped = run_python("gpumem.enable()", MODEL, VARYING_LOOP)
    cap = -(-uncapped["max_allocated"] // MiB) * MiB + 8 * MiB
    capped = run_python(f"gpumem.set_limit({cap})", MODEL, VARYING_LOOP)
    assert capped["limit"] == cap
    assert max(capped["reserved"]) <= cap
    assert capped["max_reserved"] <= cap


def test_out_of_memory_names_gpumem_and_training_continues_with_a_halved_batch(run_python):
    result = run_python(
        'gpumem.set_limit("512MB")',
        MODEL,
        """
        batch, steps, messages = 1024, 0, []
        while steps < 5:
            try:
                train_step(batch, 128)
                steps += 1
            except torch.OutOfMemoryError as error:
                messages.append(str(error))
                optimizer.zero_grad(set_to_none=True)
                batch //= 2
        print(json.dumps({
            "batch": batch,
            "steps": steps,
            "messages": messages,
            "num_ooms": torch.cuda.memory_stats()["num_ooms"],
            "max_reserved": torch.cuda.max_memory_reserved(),
            "limit": gpumem.get_limit(),
        }))
        """,
    )
    assert result["messages"], "a batch of 1024 fit under 512 MB"
    first = result["messages"][0]
    assert first.startswith("CUDA out of memory. Tried to allocate"), first  # as PyTorch's own text begins
    assert "gpumem: over the limit" in first or "gpumem: fragmentation" in first
    assert "under a limit of 512.00 MiB" in first
    assert 0 < result["batch"] < 1024
    assert result["steps"] == 5
    assert result["num_ooms"] == len(result["messages"])
    assert result["max_reserved"] <= result["limit"]
