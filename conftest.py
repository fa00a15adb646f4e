"""pytest's settings that code must make: under pytest-xdist (-n 2, as CI runs the tests), each worker computes
with one thread, so that two workers share two cores instead of four threads fighting over them."""
import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
