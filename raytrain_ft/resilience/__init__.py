"""Detecting failures and surviving them: the guards (`guards`), the step watchdog (`watchdog`),
replica recovery (`replicas`), preemption notices (`preemption`), stragglers (`straggler`), members
leaving after a step (`leaving`), the bounds of every wait (`waits`), fault injection (`faults`), the
run's recovery history (`recovery`) and the goodput planner (`planner`)."""
