"""The training loop: the trainer phase by phase (``trainer``), starting and resuming
(``run_start``), the run directory checked before it is touched (``run_directory``), the
loop's state and random streams (``run_state``), budgets and stopping a collection
(``budget``), an update's numbers (``update_metrics``), the progress display
(``progress``) and the final evaluation beside the baselines (``final_evaluation``).
It builds on the checkpoints and the run records, the rooms below it."""
