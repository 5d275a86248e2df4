"""The algorithm, on one rank: a generation's round loop (plan, one packed forward, verify, agree, publish) and
what it reads and keeps: the round layout, the Jacobi window, the n-gram pool, the candidate sources, the job
store, the replicated coordinator that plans each round, verification and the per-round records.

Nothing here knows which kernels run the forward (``backends``) or how ranks talk (``parallel``): the engine
takes an adapter, a communicator and a row plan.
"""
