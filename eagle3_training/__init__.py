"""The model drafter: an EAGLE3 head for the bundled SmolLM2, trained on CPU with `speculators`
from the target's own greedy answers to the bundled traces' prompts (`make eagle3`)."""
