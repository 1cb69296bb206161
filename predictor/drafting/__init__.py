"""What serving and replay share per draft: the suffix-cache drafter (`cache_drafter`), the accepted
length of a draft (`common_prefix`), hindsight labelling (`hindsight`), the token classes and the
features (`token_classes`, `features`). May import predictor.data and storage; serving
(controller.core) imports this, so nothing here may need predictor.data at run time."""
