"""Run by pip_install.sh with a freshly pip-installed dwgraph, from outside the source tree.

Checks that the package comes from site-packages with both binaries inside it, that they
find torch relative to themselves, and that a short graphed training loop gives the eager
loop's losses bit for bit, with the capture logged to logging.getLogger("dwgraph").
"""

import copy
import logging
import os
import pathlib
import sysconfig

import torch

import dwgraph

site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
package = pathlib.Path(dwgraph.__file__).resolve().parent
assert package == site / "dwgraph", f"dwgraph imported from {package}, expected {site / 'dwgraph'}"
binaries = sorted(p.name for p in package.iterdir() if p.suffix == ".so")
assert len(binaries) == 2 and "libdwgraph.so" in binaries, f"expected _C and libdwgraph.so in {package}, got {binaries}"
maps = pathlib.Path("/proc/self/maps").read_text()
for lib in ("libdwgraph.so", "libtorch_cpu.so"):
    paths = {line.split()[-1] for line in maps.splitlines() if line.endswith("/" + lib)}
    assert paths and all(pathlib.Path(p).resolve().is_relative_to(site) for p in paths), f"{lib} loaded from {paths}"

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


logging.getLogger("dwgraph").addHandler(Keep())
logging.getLogger("dwgraph").setLevel(logging.INFO)

torch.manual_seed(0)
eager = torch.nn.Sequential(dwgraph.nn.Linear(16, 32, delay_wgrad_compute=True),
                            dwgraph.nn.LayerNormMLP(32, 64, delay_wgrad_compute=True))
graphed_model = copy.deepcopy(eager)
g0, g1 = dwgraph.make_graphed_callables(
    (graphed_model[0], graphed_model[1]), ((torch.randn(8, 16),), (torch.randn(8, 32, requires_grad=True),)))
assert [r.levelno for r in records] == [logging.INFO] and "captured 2 callables" in records[0].getMessage(), \
    [r.getMessage() for r in records]

opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
opt_g = torch.optim.SGD(graphed_model.parameters(), lr=0.05)
target = torch.randn(8, 32)
losses = []
for step in range(5):
    x = torch.randn(8, 16)
    for forward, deferred, opt in ((eager, (eager[0], eager[1]), opt_e), (lambda x: g1(g0(x)), (g0, g1), opt_g)):
        loss = (forward(x) - target).square().mean()
        loss.backward()
        for m in deferred:
            m.backward_dw()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
eager_losses, graphed_losses = losses[0::2], losses[1::2]
assert eager_losses == graphed_losses, (eager_losses, graphed_losses)
assert graphed_losses[-1] < graphed_losses[0], graphed_losses
print(f"ok: dwgraph {dwgraph.__version__} from {package}, cuda_built={dwgraph.cuda_built()}, cwd {os.getcwd()}")
print(f"losses {graphed_losses[0]:.4f} -> {graphed_losses[-1]:.4f}, eager and graphed identical")
print(dwgraph.summary((g0, g1)))
