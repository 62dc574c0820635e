"""The copy machinery: moving a batch of address ranges, below both the stores and the devices.

* ``kvflow.copying.host``: ``copy_ranges``, one native call per batch (``kvflow._native``, built at
  install) or a Python loop of memmoves; the thread's *mover* that takes a host pool's ranges
  to a GPU instead (``moving_with``), and the movers' own loop (``issue_ranges``).
* ``kvflow.copying.cuda``: the CUDA runtime calls (``cudaMemcpyAsync``, ``cudaHostRegister``),
  found at run time: kvflow builds no CUDA code and links nothing.

These modules know addresses and sizes only: nothing of stores, layouts or engines.
"""
