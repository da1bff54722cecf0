"""autofit: the fastest LLM training plan that fits the GPUs you have.

The package is a pipeline, one layer per folder (docs/DESIGN.md draws it): ``specs``
(the target), ``plan`` and ``techniques``, ``results``, ``export``, ``evaluators`` and
``store``, ``search``, ``report``, ``cli``. A layer imports only the layers below it;
tests/test_architecture.py checks that with import-linter's contracts.
"""
