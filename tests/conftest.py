import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The switch is read when a kernel module is
# imported, so it is set here, before any test module (in any collection order) imports forerun's kernels.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass
