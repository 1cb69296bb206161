"""Defaults of the scenarios that `hvd scenario`'s options show (controller/cli/main.py reads them
at parse time, so this module imports nothing: the scenario modules import torch). The scenario
modules import them from here."""

# unseen (controller.scenarios.unseen)
UNSEEN_WINDOW_TOKENS = 20_000  # report window: tokens of the left-out source
# Each source's stream: its first sessions up to this many output tokens (five 20k windows). The
# three biggest sources hold 300k-800k tokens; serving all of them four ways takes hours here.
MAX_TOKENS = 100_000
# Each source is served this many times, with serving seeds seed, seed + 1, ... (the model drafter's
# simulated outcomes, the learner's sampling), from the same warm start. A promotion that lands a
# window earlier or later moves a source's gain by half a percent either way, as much as the gains
# themselves: one seed's table says little about learning on against off.
REPEATS = 3

# shift (controller.scenarios.shift)
SHIFT_WINDOW_TOKENS = 2000  # report window: tokens of the arriving workload
OTHERS = 400  # requests of the other workloads served before the left-out workload arrives
