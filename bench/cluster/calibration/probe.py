# Contention probe: how fast a rank computes while one of its NCCL kernels is resident (waiting
# for a peer that has not joined yet), against the same work with no collective in flight. Two
# processes on one GPU under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), like the cluster's ranks.
import json, os, sys, time
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda:0"))
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
y = torch.empty_like(x)
buf = torch.zeros(1 << 22, device="cuda", dtype=torch.bfloat16)


def timed(kind, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        if kind == "gemm":
            torch.mm(a, b)
        else:
            y.copy_(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


out = {}
for kind, n in (("gemm", 20), ("copy", 40)):
    timed(kind, 3)
    dist.barrier()
    torch.cuda.synchronize()
    dist.all_reduce(buf)  # warm
    torch.cuda.synchronize()
    dist.barrier()
    base = timed(kind, n)  # both ranks busy, nothing in flight
    dist.barrier()
    if rank == 0:
        work = dist.broadcast(buf, 1, async_op=True)  # resident until rank 1 joins
        pend = timed(kind, n)
        work.wait()
    else:
        timed(kind, 2 * n)  # rank 1 stays busy longer, then joins
        dist.broadcast(buf, 1)
        pend = None
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        out[kind] = {"alone_ms": base * 1e3, "beside_waiting_nccl_ms": pend * 1e3,
                     "slowdown": pend / base}
if rank == 0:
    print("PROBE", json.dumps(out))
    json.dump(out, open(sys.argv[1], "w"), indent=1)
dist.destroy_process_group()
