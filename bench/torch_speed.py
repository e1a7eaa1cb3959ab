"""torch_speed.py -- the PyTorch side of `make bench` (bench/run_speed.sh runs it).

    python3 torch_speed.py mlp BATCH [seconds] [threads] [device]
    python3 torch_speed.py cnn BATCH [seconds] [threads] [device] [math]

device: cpu (default) or cuda (bench/run_gpu.sh): the model and the whole
synthetic data set on the GPU, each window ending with torch.cuda.synchronize()
as bench_gpu.c ends its windows with the device synchronised; exits 3 with
"skipped: ..." when torch has no CUDA device. math (cuda only): fp32 (strict
float32 products, as dtrain computes them: torch.backends.cudnn.allow_tf32 and
torch.backends.cuda.matmul.allow_tf32 False), tf32 (both True) or default
(PyTorch's defaults: TF32 in cuDNN's convolutions, fp32 in matrix products).

The same models, optimizer (Adam, lr 1e-3; here the multi-tensor foreach=True
variant, PyTorch's fastest on the CPU), synthetic data set (4096 samples of
28x28, cycled) and timing as bench_speed.c: the best of several short windows
(10 steps for the MLP at batch 64, 4 at 256, 1 for the CNN) after 3 warm-up
steps. Threads: torch.set_num_threads(threads) (default 1),
with OMP_NUM_THREADS / MKL_NUM_THREADS / OPENBLAS_NUM_THREADS set to the same
number before torch is imported. Prints one line
"result samples_per_s=... peak_rss_kb=..." (peak RSS: VmHWM of this process).
"""
import os
import sys

mode = sys.argv[1] if len(sys.argv) > 1 else "mlp"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
math_mode = sys.argv[6] if len(sys.argv) > 6 else "default"
if math_mode not in ("fp32", "tf32", "default"):
    sys.exit("torch_speed.py: math is fp32, tf32 or default, not %r" % math_mode)
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(threads)

import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(threads)
if math_mode != "default":
    torch.backends.cudnn.allow_tf32 = math_mode == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = math_mode == "tf32"
try:
    torch.set_num_interop_threads(threads)
except RuntimeError:
    pass
torch.manual_seed(1)
if device != "cpu" and not torch.cuda.is_available():
    print("skipped: torch.cuda.is_available() is False (torch %s)" % torch.__version__)
    sys.exit(3)


def sync():
    if device != "cpu":
        torch.cuda.synchronize()

NSAMPLES = 4096


def peak_rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


if mode == "mlp":
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    xs = torch.rand(NSAMPLES, 784)
else:
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 1024), nn.ReLU(), nn.Linear(1024, 10))
    xs = torch.rand(NSAMPLES, 1, 28, 28)
ys = torch.randint(0, 10, (NSAMPLES,))
model = model.to(device)
xs = xs.to(device)
ys = ys.to(device)
# foreach=True (multi-tensor Adam) and zero_grad(set_to_none=True) are PyTorch's
# fastest stock CPU settings here (foreach: ~1.7x the 1.13 default at batch 64).
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
nbatches = NSAMPLES // batch
# Windows of a few steps (~10 ms for the MLP, one step for the CNN), as in
# bench_speed.c: the best window is the least disturbed one.
per_window = 1 if mode == "cnn" else (4 if batch >= 256 else 10)

rates = []
steps = 0
window = 0
t_first = t_end = tw = c_first = 0.0
s = 0
loss = None
while True:
    if s == 3:
        sync()
        t_first = time.perf_counter()
        c_first = time.process_time()
        t_end = t_first + seconds
        tw = t_first
    bi = s % nbatches
    xb = xs[bi * batch:(bi + 1) * batch]
    yb = ys[bi * batch:(bi + 1) * batch]
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    if s >= 3:
        steps += 1
        window += 1
        if window == per_window:
            sync()
            now = time.perf_counter()
            rates.append(window * batch / (now - tw))
            window = 0
            tw = now
            if now > t_end and len(rates) >= 3:
                break
    s += 1
cpu = steps * batch / (time.process_time() - c_first)
rates.sort()


def blas_core():
    """The kernel of the OpenBLAS this process loaded (torch's BLAS), or '-'."""
    try:
        import ctypes
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "openblas" in ln and ".so" in ln})
        for lib in libs:
            fn = ctypes.CDLL(lib).openblas_get_corename
            fn.restype = ctypes.c_char_p
            return fn().decode()
    except (OSError, AttributeError):
        pass
    return "-"


def aten_isa():
    """The instruction set of PyTorch's own CPU kernels (elementwise ops, Adam): 'AVX2' unless
    ATEN_CPU_CAPABILITY raises it (PyTorch 1.13 does not pick AVX-512 on its own), or '-'."""
    for ln in torch.__config__.show().splitlines():
        if "CPU capability usage:" in ln:
            return ln.split(":", 1)[1].strip().replace(" ", "_")
    return "-"


def onednn_isa():
    """The most oneDNN (PyTorch's convolutions) may use: the cap set by ONEDNN_MAX_CPU_ISA
    (or DNNL_MAX_CPU_ISA), else 'best' (the best the CPU has)."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "best"


print("result samples_per_s=%.1f median_samples_per_s=%.1f cpu_samples_per_s=%.1f windows=%d peak_rss_kb=%d "
      "loss=%.4f torch=%s threads=%d blas_core=%s aten_isa=%s onednn_isa=%s"
      % (rates[-1], rates[len(rates) // 2], cpu, len(rates), peak_rss_kb(), loss.item(), torch.__version__,
         torch.get_num_threads(), blas_core(), aten_isa(), onednn_isa()))
