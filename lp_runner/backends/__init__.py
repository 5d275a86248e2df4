"""Forward backends: the one adapter around a Hugging Face model's forward and K/V cache (packed rounds, static
and compiled rounds, the attention mask), and the kernels it may run on (``backends.cpu``: lp_runner's own CPU
kernels, a plug-in chosen at load).
"""
