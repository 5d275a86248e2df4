"""A job of many prompts: one worker's start-up and prompt loop, records, the output file and its lock, the
summary, the D-group work queue and the Ray driver and actors.
"""
