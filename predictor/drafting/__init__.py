"""What serving and replay share per draft: the suffix-cache drafter (`cache_drafter`), the accepted
length of a draft (`common_prefix`), hindsight labelling (`hindsight`), the token classes and the
features (`token_classes`, `features`). Imports no other predictor sub-package (storage only):
serving (controller.core) imports this and needs no trace loader."""
