"""pytest's settings that code must make: under pytest-xdist (-n 2, as CI runs the tests), each worker computes
with one thread, so that two workers share two cores instead of four threads fighting over them; and a run
under ATEN_CPU_CAPABILITY, unless TORCHINDUCTOR_CACHE_DIR names a cache, compiles into an Inductor cache of
its own."""
import getpass
import os
import tempfile

import torch

# torch 2.13's FX graph cache keys the C++ it generates without the vector width it was written for (which
# ATEN_CPU_CAPABILITY picks): written under avx2 and rebuilt for AVX-512, it corrupted the heap here.
if os.environ.get("ATEN_CPU_CAPABILITY") and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
