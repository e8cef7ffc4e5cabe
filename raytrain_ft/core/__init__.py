"""The bottom layer: the contracts and rules every other sub-package builds on (errors, the config
schema, the run folder's layout, step hooks, the recorder interface, bounded waits, the LR schedule).
It imports nothing of raytrain_ft above it (`tests/unit/test_import_rules.py`)."""
