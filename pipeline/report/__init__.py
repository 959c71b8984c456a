"""What users look at: breakdown plots of a profile (plots.py), the run report in Markdown and
self-contained HTML (document.py, run_report.py), and the sweep comparison (sweep.py)."""
