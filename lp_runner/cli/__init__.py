"""The command line: ``run`` (the default), ``tune`` and ``fetch``; argument checks, output opening, the launcher
choice and the self-launched torchrun of ``parallel.workers``.
"""
