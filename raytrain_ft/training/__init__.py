"""The training loop and what it runs with: `loop.Trainer` (the algorithm), `run_components` (its
parts, built before an attempt), `session` (the loop's one seam to its runtime: Ray, or
`local_session` without it), validation, the preflight and run extension."""
