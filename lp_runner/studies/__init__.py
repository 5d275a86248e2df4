"""Strong-scaling studies: the simulation of Lookahead Parallelism with its lever (the window grows with P) and
the measured study (the user's job at each P). ``python -m lp_runner study`` (``cli/study.py``) is the entry."""
