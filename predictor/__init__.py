"""The predictor: everything below the controller that decides, learns and evaluates, in sub-packages
that import one another one way (tests/test_architecture.py holds the table): data -> drafting ->
gate; decision alone; replay, evaluation, online on top; warmstart over all of them. Serving
(controller.core) uses only drafting, gate and decision."""
