"""`python -m batchgen.report PATH ...`: tables and plots from the files runs wrote (never the engine or torch)."""
