"""What people see: the answer of a study and why (``analysis``), the console
(``console``: progress, tables, JSON), the figures (``plots``) and the HTML page
(``html``).

Reads stored results and may call the analytic evaluator and the exporter; never the
search loop or the CLI.
"""
