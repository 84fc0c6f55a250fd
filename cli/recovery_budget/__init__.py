"""The recovery budget: the RTO model, each component with its source, what a run's history says,
measurements made now (verify, read bandwidth, no-op attempts, probes), and the estimate's report.

It builds on the supervision engine's primitives (the launch spec, an attempt's process tree, the restart
policy's defaults) and never imports the commands. Importable without torch.
"""
