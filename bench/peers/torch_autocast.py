# bench/peers/torch_autocast.py — runs a PyTorch peer script (argv[1], its arguments after it) under
# torch.autocast('cpu', dtype=torch.bfloat16): PyTorch's CPU mixed precision, matmuls in bf16
# through oneDNN (AMX tiles where the CPU has them), what bench/train.lua --precision bf16 --torch
# compares ours with. Prints whether oneDNN (mkldnn) is built in.
import runpy
import sys

import torch

script = sys.argv[1]
sys.argv = sys.argv[1:]
print(f"autocast: cpu bfloat16, torch {torch.__version__}, mkldnn available {torch.backends.mkldnn.is_available()}",
      flush=True)
with torch.autocast('cpu', dtype=torch.bfloat16):
    runpy.run_path(script, run_name='__main__')
