"""Pure decision code: the cost and drafter profiles (`profiles`, `profiles.toml`), the verification
allocator (`allocator`), the binary goodput rule (`binary_rule`), the model drafter's live survival
curves (`drafter_survival`). Imports no other predictor sub-package (storage only)."""
