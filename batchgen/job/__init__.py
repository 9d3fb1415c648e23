"""A job's life: read -> engine -> write, resume check, run outputs, stop signals, progress, summary."""
