"""What people see: the answer of a study and why (``analysis``), the console
(``console``: progress, tables, JSON), the figures (``plots``) and the HTML page
(``html``).

Formatting only: every value shown comes from stored results or an evaluator's call.
May import every layer below it (search, store, evaluators, export, results, specs);
never the CLI.
"""
