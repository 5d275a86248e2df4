"""Verification: which candidate tokens the target model accepts, greedy (token identity) or sampled (exact
residual sampling), the winner rule each implies under LP, and what "exact" means in half precision.
"""
