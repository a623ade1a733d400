"""One intra-op thread: the machines running these tests have two cores, shared."""

import torch

torch.set_num_threads(1)
