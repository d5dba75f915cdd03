"""FedProIn against the paper's baselines on real HAM10000 and blood-cell data (``run.py``)."""
