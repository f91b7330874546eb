"""What a run leaves to be read: the readers of its files (``run_files``), the report
and metrics records (``report``), the transcripts (``transcripts``), the one-writer lock
(``run_lock``) and the exported model (``export``). The lowest room of training: it uses
nothing of the loop or the checkpoints."""
