"""Scripted experiments on the replay engine, run by `hvd scenario NAME` (controller/cli/main.py is
only their command-line edge): `unseen` leaves one bundled source out of the warm start and serves
it learning on, learning off and against the oracles; `shift` warm-starts without one workload and
then lets it arrive. Each trains predictors, serves on its own throwaway databases and writes a
report. `defaults` holds the figures the `hvd scenario` parser shows, in a module light enough for
`hvd --help` (the scenarios themselves import torch)."""
