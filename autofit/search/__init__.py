"""The search: from a request to the fastest plan that fits.

Owns the user's request (``request``: model, GPUs, workload, options -> a ``Target``),
the search space (``space``: Optuna trial -> ``Plan``), the loop that any number of
workers share (``loop``: screening, warm start, the budget of evaluated plans, lost
trials, the outcome), study files (``studies``), local worker processes (``workers``)
and the calibration of predictions by measurements (``calibration``).

May import the store, the evaluators and everything below them; never the report or
the CLI.
"""
