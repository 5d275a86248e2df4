"""Lookahead Parallelism and D groups: how ranks share a round (column and candidate sharding), exchange its
verdicts (one all_gather), communicate (process groups with bounded waits) and share a job's prompts (groups).
"""
