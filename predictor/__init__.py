"""The predictor: everything below the controller that decides, learns and evaluates, in sub-packages
that import one another one way (tests/test_architecture.py holds the table, PREDICTOR_LAYERS):
data, drafting and decision import no other sub-package; gate imports drafting; replay imports data
and drafting; evaluation all of those; online those and evaluation; warmstart any. Serving
(controller.core) uses only drafting, gate and decision: no trace loader, no learner."""
