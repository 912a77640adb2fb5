"""CI: a core-only install (`pip install cotangent`, torch its only dependency) works.

Run with the core-only environment's Python: the library imports; cotangent.AdamW (with its
built-in clip) and cotangent.Muon give native's bytes for a few steps on a small model; the
harness (every module of cotangent.harness) is not importable without its extra, and the
`cotangent` command says which extra to install in one line (exit status 2, no traceback)."""

import importlib.util
import os
import subprocess
import sys

import torch

import cotangent
from cotangent.verify import first_difference

for name in ("numpy", "scipy", "matplotlib", "tqdm"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed in the core-only env"
harness_dir = os.path.join(os.path.dirname(cotangent.__file__), "harness")
modules = sorted(f[:-3] for f in os.listdir(harness_dir) if f.endswith(".py"))
assert "cli" in modules and "audit" in modules, modules
for module in modules:
    name = "cotangent.harness" + ("" if module == "__init__" else "." + module)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        assert exc.name in ("numpy", "scipy", "matplotlib", "tqdm"), (name, exc)
        assert "pip install 'cotangent[harness]'" in str(exc), (name, exc)
    else:
        raise AssertionError(f"{name} imported without the harness extra")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16, bias=False))


def run(make_native, make_ours, clip):
    a, b = model(), model()
    opt_a, opt_b = make_native(a), make_ours(b)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(8, 16, generator=gen)
        for m, opt, native in ((a, opt_a, True), (b, opt_b, False)):
            m(x).square().mean().backward()
            if native and clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            problem = first_difference(p, q)
            assert problem is None, f"step {step}: {problem}"
    return step + 1


n = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda m: cotangent.AdamW(m.parameters(), lr=1e-2, max_norm=0.05), clip=True)
mats = lambda m: [p for p in m.parameters() if p.ndim == 2]  # noqa: E731
n += run(lambda m: torch.optim.Muon(mats(m), lr=0.02),
         lambda m: cotangent.Muon(mats(m), lr=0.02), clip=False)
cli = os.path.join(os.path.dirname(sys.executable), "cotangent")
out = subprocess.run([cli, "train"], capture_output=True, text=True)
assert out.returncode == 2, out
assert "pip install 'cotangent[harness]'" in out.stderr and "Traceback" not in out.stderr, out
print(f"core-only install: torch {torch.__version__}; AdamW and Muon bitwise over {n} steps; "
      "harness refused with a one-line message")
# the campaign audit runs as a bare file on the standard library alone (here: no numpy at all)
audit_py = os.path.join(harness_dir, "audit.py")
results = os.path.join(os.path.dirname(__file__), "..", "results", "occurrence-cpu")
out = subprocess.run([sys.executable, "-I", "-S", audit_py, results], capture_output=True,
                     text=True)
assert out.returncode == 0 and "clean (Python" in out.stdout, out
print("core-only: the audit ran as a bare file:", out.stdout.strip().splitlines()[-1])
