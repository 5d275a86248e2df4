"""lp_runner's CPU kernels, a forward backend plug-in: linear layers prepacked for the native product or oneDNN,
the native attention and whole Llama-family decoder layers in C (``csrc/``), the packed-weight arena, and the
custom ops that let a compiled graph call them.

Only ``lp_runner.backends`` imports it (``select_backend`` for a model on a CPU, ``detect_backend`` for one packed
before), through ``backend.py``: ``prepare`` applies the kernels to a model and returns its ``CpuBackend``;
``detect`` finds that backend for a model packed earlier. Nothing above the backends names a kernel. This file
imports nothing, so that importing one kernel module does not import the others.
"""
