# Contention probe 2: a rank computing while its NCCL kernels move data (a 1 GiB broadcast from
# rank 0 to rank 1), against each alone. Two processes on one GPU under MPS.
import json, os, sys, time
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda:0"))
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
y = torch.empty_like(x)
buf = torch.zeros(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB


def work(kind, n):
    for _ in range(n):
        if kind == "gemm":
            torch.mm(a, b)
        else:
            y.copy_(x)


def comm_alone():
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    t = time.perf_counter()
    dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def compute_alone(kind, n):
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); work(kind, n); e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3


def together(kind, n):
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    w = dist.broadcast(buf, 0, async_op=True)
    s.record(); work(kind, n); e.record()
    while not w.is_completed():
        time.sleep(20e-6)
    tc = time.perf_counter() - t0
    torch.cuda.synchronize()
    return tc, s.elapsed_time(e) / 1e3


for _ in range(2):
    comm_alone(); compute_alone("gemm", 2); compute_alone("copy", 2)
out = {}
med = lambda v: sorted(v)[len(v) // 2]
c = med([comm_alone() for _ in range(5)])
for kind in ("gemm", "copy"):
    one = compute_alone(kind, 1)
    n = max(1, int(3 * c / one))
    alone = med([compute_alone(kind, n) for _ in range(3)])
    tog = [together(kind, n) for _ in range(3)]
    tc, tk = med([t[0] for t in tog]), med([t[1] for t in tog])
    out[kind] = {"n": n, "comm_alone_ms": c * 1e3, "compute_alone_ms": alone * 1e3,
                 "comm_beside_compute_ms": tc * 1e3, "compute_beside_comm_ms": tk * 1e3}
allr = [None] * world
dist.all_gather_object(allr, out)
if rank == 0:
    print("PROBE2", json.dumps(allr))
    json.dump(allr, open(sys.argv[1], "w"), indent=1)
dist.destroy_process_group()
