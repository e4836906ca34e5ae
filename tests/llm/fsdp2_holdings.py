"""What each rank of a real FSDP2 run holds: the bytes of its parameter shards, gradients and
AdamW state, after one training step of a model folder (tests/test_llm_plan.py compares them
with what examples/llm/plan_memory.py plans).

    torchrun --standalone --nproc-per-node=2 fsdp2_holdings.py MODEL_FOLDER

Runs on CPUs (gloo), in float32 as the planner's sharded state is. Rank 0 prints one JSON
object: {"ranks": [{"weights": B, "gradients": B, "optimizer": B}, ...], "parameters": N}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from transformers.utils import logging


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def main():
    dist.init_process_group("gloo")
    logging.disable_progress_bar()  # only the JSON line
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)  # the same tokens in every rank
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = [local(p) for p in model.parameters()]
    state = [local(value) for each in optimizer.state.values() for value in each.values()
             if torch.is_tensor(value)]  # fmt: skip
    held = {
        "weights": tensor_bytes(params),
        "gradients": tensor_bytes(local(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": tensor_bytes(state),
        "step_counters": tensor_bytes(t for t in state if t.dim() == 0),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, held)
    if dist.get_rank() == 0:
        sys.stdout.write(json.dumps({"ranks": ranks, "parameters": parameters}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
