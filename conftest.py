"""pytest's settings that code must make: under pytest-xdist (-n 2, as CI runs the tests), each worker computes
with one thread, so that two workers share two cores instead of four threads fighting over them; and a run
under ATEN_CPU_CAPABILITY compiles into an Inductor cache of its own."""
import os
import tempfile

import torch

# torch 2.13's Inductor cache does not key the CPU code it compiles on ATEN_CPU_CAPABILITY: code compiled under
# ATEN_CPU_CAPABILITY=avx2 and replayed without it aborted the next test run here.
if os.environ.get("ATEN_CPU_CAPABILITY") and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.environ['ATEN_CPU_CAPABILITY']}")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
