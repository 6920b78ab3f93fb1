"""distmuon.torch.Muon.step() alone on the demo's model (examples/train_gpt.py's CPU preset) with fixed
gradients: python3 front_step.py [STEPS], DRV_THREADS torch threads (default 1); prints the median,
the minimum and the CPU time (getrusage) per step. Run from the repository root."""
import os, sys, time, resource
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../examples"))
import torch
import train_gpt as tg
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
threads = int(os.environ.get("DRV_THREADS", "1"))
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = tg.GPTConfig(vocab=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
model = tg.GPT(cfg)
opts = tg.build_optimizers("distmuon", model, tg.HParams(adamw_lr=0.003), None)
x = torch.randint(0, 65, (16, 64)); y = torch.randint(0, 65, (16, 64))
loss = model(x, y); loss.backward()
for o in opts: o.step()
ts = []
r0 = resource.getrusage(resource.RUSAGE_SELF)
for i in range(steps):
    t = time.perf_counter()
    for o in opts: o.step()
    ts.append(time.perf_counter() - t)
r1 = resource.getrusage(resource.RUSAGE_SELF)
ts.sort()
cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / steps
print(f"front+engine step: median {ts[len(ts)//2]*1e3:.2f} ms min {ts[0]*1e3:.2f} ms, cpu {cpu*1e3:.2f} ms/step ({threads} threads)")
