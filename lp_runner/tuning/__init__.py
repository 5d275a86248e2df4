"""Choosing how to run: the forward-cost curve measured at start-up, the cost model that prices round shapes on
it, the one search over settings (quick at start-up, thorough in ``lp_runner tune``), the per-worker round
policy, D x P splits and the keyed records that cache measurements.
"""
