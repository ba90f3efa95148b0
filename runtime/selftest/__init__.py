"""`npuport selftest`: each kernel and native operator against its reference on the device present (kernel_checks.py,
tolerance.py, timing.py), a tiny model's greedy tokens with and without graphs and with MTP (model_checks.py), run
and reported by run.py. Imports the engine (runtime), the kernels and the shared helpers; nothing imports it but the
command line and the validator's report."""
