"""The batch job: readers, writers, the commit journal, and the run/resume lifecycle."""
