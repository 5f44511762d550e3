"""The benchmarks: `python -m research.bench NAME` runs one (`python -m research.bench --help` lists them), each
in its own module of this package and registered in `cli.py`; `report.py` formats and writes their tables,
`timing.py` builds and times the trainer's real step for those that need it.

  python -m research.bench train                            # small and base, 1 device and 8 simulated ones
  python -m research.bench train --presets base --meshes data=1 fsdp=8 --steps 10 --out runs/bench_train.md
  python -m research.bench optim --out research/results/bench_optim.md             # optim.py
  python -m research.bench comm --out research/results/bench_comm.md               # comm.py
  python -m research.bench reshard --out research/results/bench_reshard.md         # reshard.py
  python -m research.bench moe --out research/results/bench_moe.md                 # moe.py
  python -m research.bench ckpt --out research/results/bench_ckpt.md               # ckpt.py
  python -m research.bench dion --out research/results/bench_dion_comm.md          # dion.py
  python -m research.bench attention --out research/results/bench_attention.md     # attention.py
  python -m research.bench hf --out research/results/bench_hf_import.md            # hf.py
  python -m research.bench quant --out research/results/bench_quant.md             # quant.py
  python -m research.bench sample --out research/results/bench_sample.md           # sample.py
  python -m research.bench data --out research/results/bench_data.md               # data.py (8 GB on disk)

A new benchmark: one module with one function whose keyword arguments are its flags (or a dataclass of them), added
to `BENCHMARKS` in `cli.py`; it reports through `report.publish` (or `report.Progress` for a long one) and records
its command line.
"""
